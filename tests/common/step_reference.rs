//! The exact (f64) optimizer step of one element from the state it started from, and the bound
//! each f32 step meets: the independent reference of the optimizer's tests.

use gradacc::Algorithm;

/// One unit of f32 rounding.
pub const U: f64 = 1.0 / (1u64 << 24) as f64;

/// How far `got` is from `exact`, in units of f32 rounding of `magnitude`.
pub fn ulps(got: f32, exact: f64, magnitude: f64) -> f64 {
    if got as f64 == exact {
        return 0.0;
    }
    (got as f64 - exact).abs() / (U * magnitude.max(f64::MIN_POSITIVE))
}

/// The bound each step meets, per element and quantity: within this many f32 roundings of the
/// magnitudes of the quantity's terms, from the state the step started from.
pub const BOUND: f64 = 8.0;

/// The bound of each quantity of `algorithm`, in [`check_element`]'s order: [`BOUND`], but
/// AdamW's first moment for beta1 < 0.1, 3 + 1 / (2 beta1).
///
/// The first moment is `lerp(m, g, w)` with `w = fl(1 - beta1)`: three roundings (a
/// subtraction, a product, a sum) of at most `u` times `beta1 |m| + (1 - beta1) |g|` each, to
/// first order, plus what `w` misstates. For beta1 >= 0.5, 1 - beta1 is an f32 and `w` exact.
/// Below, the lerp computes `g - (g - m) (1 - w)`, where `1 - w` (exact) is beta1 off by the
/// rounding of 1 - beta1 in (0.5, 1), at most 2^-25 = u / 2: an error of up to
/// `(|g| + |m|) u / 2`, at most `u / (2 beta1)` times `beta1 |m| + (1 - beta1) |g|`. So at most
/// 3 + 1 / (2 beta1) roundings, above 8 only for beta1 < 0.1.
pub fn bounds(algorithm: Algorithm) -> [f64; 3] {
    match algorithm {
        Algorithm::AdamW { beta1, .. } => [BOUND, BOUND.max(3.0 + 0.5 / beta1 as f64), BOUND],
        Algorithm::Sgd { .. } => [BOUND; 3],
    }
}

/// Fails unless each distance of `dist` (from [`check_element`]) is within its bound; `what`
/// names the element.
pub fn assert_within(algorithm: Algorithm, dist: [f64; 3], what: &dyn Fn() -> String) {
    let bound = bounds(algorithm);
    for (q, name) in ["weight", "first moment", "second moment"].iter().enumerate() {
        assert!(
            dist[q] <= bound[q],
            "{algorithm:?} {}: the {name} is {} roundings from exact (bound {})",
            what(),
            dist[q],
            bound[q]
        );
    }
}

/// Checks one step of one element against exact arithmetic; returns how far (in roundings of
/// their terms) the master weight, the first moment (SGD: the momentum buffer) and the second
/// moment (AdamW) are from exact.
#[allow(clippy::too_many_arguments)]
pub fn check_element(
    algorithm: Algorithm,
    lr: f64,
    decays: bool,
    t: i32,
    g: f64,
    before: (f64, f64, f64),
    after: (f32, f32, f32),
) -> [f64; 3] {
    let (w, m, v) = before;
    let (w1, m1, v1) = after;
    match algorithm {
        Algorithm::AdamW { beta1, beta2, eps, weight_decay } => {
            let (b1, b2, eps) = (beta1 as f64, beta2 as f64, eps as f64);
            let wd = if decays { weight_decay as f64 } else { 0.0 };
            let m_exact = m + (1.0 - b1) * (g - m);
            let v_exact = b2 * v + (1.0 - b2) * g * g;
            // The weight from the step's own moments: each quantity's rounding on its own.
            let denom = (v1 as f64).sqrt() / (1.0 - b2.powi(t)).sqrt() + eps;
            let update = lr / (1.0 - b1.powi(t)) * m1 as f64 / denom;
            let w_exact = w * (1.0 - lr * wd) - update;
            [
                ulps(w1, w_exact, w.abs() + update.abs()),
                ulps(m1, m_exact, b1 * m.abs() + (1.0 - b1) * g.abs()),
                ulps(v1, v_exact, b2 * v + (1.0 - b2) * g * g),
            ]
        }
        Algorithm::Sgd { momentum, dampening, nesterov, weight_decay } => {
            let wd = if decays { weight_decay as f64 } else { 0.0 };
            let (mo, keep) = (momentum as f64, 1.0 - dampening as f64);
            let d = g + wd * w;
            let mut momentum_dist = 0.0f64;
            let step = if momentum == 0.0 {
                d
            } else {
                let m_exact = if t == 1 { d } else { m * mo + keep * d };
                momentum_dist =
                    ulps(m1, m_exact, (m * mo).abs() + keep * (g.abs() + (wd * w).abs()));
                if nesterov {
                    d + mo * m1 as f64
                } else {
                    m1 as f64
                }
            };
            let w_exact = w - lr * step;
            // The terms of the step: the gradient, the decay and (Nesterov) the momentum.
            let terms =
                g.abs() + (wd * w).abs() + if nesterov { mo * (m1 as f64).abs() } else { 0.0 };
            let terms = if momentum == 0.0 || nesterov { terms } else { (m1 as f64).abs() };
            [ulps(w1, w_exact, w.abs() + lr * terms), momentum_dist, 0.0]
        }
    }
}
