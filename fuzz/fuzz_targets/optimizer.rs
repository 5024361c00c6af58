//! The optimizer's part of the C API model: each live optimizer with the accumulator it was made
//! over (which it outlives), the model's weights it owns, its learning rate, step count and the
//! window it last stepped from, and for plain f32 SGD a shadow of its FP32 masters, compared bit
//! for bit with the weights each step writes and, for an optimizer over the caller's masters
//! (gradacc_optimizer_create_with_masters), with that buffer.

use super::*;

/// A live optimizer.
pub(crate) struct OptModel {
    pub handle: *mut gradacc_optimizer_t,
    /// The accumulator it was made over; null once that accumulator is destroyed.
    pub acc: *mut gradacc_accumulator_t,
    numels: Vec<usize>,
    /// The model's weights, one buffer per tensor (a word per element, so any dtype fits aligned,
    /// and one more for a misaligned pointer).
    weights: Vec<Vec<u32>>,
    /// What a saved part must hold first: tensors, model dtypes, algorithm and rounding.
    identity: Vec<u64>,
    second_moment: bool,
    lr: f32,
    steps: u64,
    /// The accumulator's sync count at the window last stepped from (or skipped).
    consumed: Option<u64>,
    /// Plain SGD (no momentum) on f32 weights: the masters, and each tensor's weight decay and
    /// lr_scale.
    shadow: Option<Shadow>,
    /// The caller's masters it adopted (the accumulator's flat layout over the held range), kept
    /// alive as long as the optimizer, and each tensor's offset in them when it holds the whole
    /// layout (what the shadow is compared with).
    adopted: Option<(Vec<f32>, Option<Vec<usize>>)>,
}

struct Shadow {
    master: Vec<Vec<f32>>,
    decay: Vec<f32>,
    lr_scale: Vec<f32>,
}

impl OptModel {
    /// `w = w - lr * (g + wd * w)` per element in f32, the scalars rounded from f64 once per
    /// tensor, as src/optimizer/update.rs defines SGD without momentum.
    fn shadow_step(&mut self, a: &AccModel) {
        let lr = self.lr;
        let Some(s) = &mut self.shadow else { return };
        for (t, master) in s.master.iter_mut().enumerate() {
            let neg_lr = (-(lr as f64 * s.lr_scale[t] as f64)) as f32;
            let wd = s.decay[t];
            for (k, w) in master.iter_mut().enumerate() {
                let g = a.w.sim[a.offsets[t] + k];
                let d = if wd != 0.0 { g + wd * *w } else { g };
                *w += neg_lr * d;
            }
        }
    }

    /// The weights as f32 bit patterns, and adopted masters, must equal the shadow masters.
    fn check_shadow(&self) {
        let Some(s) = &self.shadow else { return };
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        for (t, master) in s.master.iter().enumerate() {
            for (k, &m) in master.iter().enumerate() {
                let w = f32::from_bits(self.weights[t][k]);
                assert!(same(w, m), "optimizer weight {t}[{k}]: library {w:e}, model {m:e}");
                if let Some((buffer, Some(at))) = &self.adopted {
                    let b = buffer[at[t] + k];
                    assert!(same(b, m), "adopted master {t}[{k}]: library {b:e}, model {m:e}");
                }
            }
        }
    }
}

/// A saved optimizer state as the model reads it: the learning rate, the step count, and per
/// tensor the elements held and their masters.
struct SavedOpt {
    lr: f32,
    steps: u64,
    tensors: Vec<(usize, usize, Vec<f32>)>,
}

/// One part, if the library must accept it for `o` (format GAOP 1).
fn decode_part(bytes: &[u8], o: &OptModel) -> Option<SavedOpt> {
    // Version 1 (FP32 state), or 2, which names the state formats: this model's optimizers keep
    // FP32 state (formats 0 and 0).
    let version = bytes.get(4..8).map(|v| u32::from_le_bytes(v.try_into().unwrap()));
    if bytes.len() < 16 || &bytes[..4] != b"GAOP" || !matches!(version, Some(1 | 2)) {
        return None;
    }
    let (body, tail) = bytes.split_at(bytes.len() - 8);
    if fnv(body).to_le_bytes() != tail {
        return None;
    }
    let mut r = Reader(body, 8);
    for &id in &o.identity {
        if r.u64()? != id {
            return None;
        }
    }
    if version == Some(2) && (r.u64()?, r.u64()?) != (0, 0) {
        return None;
    }
    let (lr, steps) = (r.f32()?, r.u64()?);
    let mut tensors = vec![];
    for &numel in &o.numels {
        let (start, end) = (r.u64()?, r.u64()?);
        if start > end || end > numel as u64 {
            return None;
        }
        let n = (end - start) as usize;
        let mut master = vec![];
        for slot in 0..if o.second_moment { 3 } else { 2 } {
            if r.u64()? != n as u64 {
                return None;
            }
            let values: Vec<f32> = (0..n).map(|_| r.f32()).collect::<Option<_>>()?;
            if slot == 0 {
                master = values;
            }
        }
        tensors.push((start as usize, end as usize, master));
    }
    (r.1 == body.len()).then_some(SavedOpt { lr, steps, tensors })
}

/// The state `parts` restore, if the library must accept them: each part valid, all saved at one
/// step and lr, the lr valid, every element covered by exactly one part.
fn decode_parts(parts: &[Vec<u8>], o: &OptModel) -> Option<SavedOpt> {
    let parts: Vec<SavedOpt> = parts.iter().map(|p| decode_part(p, o)).collect::<Option<_>>()?;
    let first = parts.first()?;
    let (lr, steps) = (first.lr, first.steps);
    if parts.iter().any(|p| (p.lr.to_bits(), p.steps) != (lr.to_bits(), steps))
        || !(lr.is_finite() && lr >= 0.0)
    {
        return None;
    }
    let mut tensors = vec![];
    for (t, &numel) in o.numels.iter().enumerate() {
        let mut master = vec![None; numel];
        for p in &parts {
            let (start, end, values) = &p.tensors[t];
            for e in *start..*end {
                // An element held by two parts (a part given twice) is refused.
                if master[e].replace(values[e - start]).is_some() {
                    return None;
                }
            }
        }
        tensors.push((0, numel, master.into_iter().collect::<Option<Vec<f32>>>()?));
    }
    Some(SavedOpt { lr, steps, tensors })
}

impl World {
    fn opt_arg(&mut self, input: &mut Input) -> (*mut gradacc_optimizer_t, Option<usize>) {
        match self.pick(input, self.opts.len()) {
            Pick::Live(i) => (self.opts[i].handle, Some(i)),
            Pick::Null => (null_mut(), None),
            p => {
                let h = self.stray(p);
                (h as *mut _, self.opts.iter().position(|o| o.handle as usize == h))
            }
        }
    }
}

/// The calls on optimizers.
pub(crate) fn optimizer_call(world: &mut World, input: &mut Input) {
    match input.below(10) {
        0 | 1 => create(world, input),
        2..=4 => step(world, input),
        5 => set_lr(world, input),
        6 => queries(world, input),
        7 => save(world, input),
        8 => load(world, input),
        _ => {
            let (h, live) = world.opt_arg(input);
            // SAFETY: any handle value is reported, never dereferenced.
            let st = unsafe { gradacc_optimizer_destroy(h) };
            if world.check("gradacc_optimizer_destroy", st, h.is_null() || live.is_some())
                && !h.is_null()
            {
                world.opts.remove(live.unwrap());
                world.dead.push(h as usize);
            }
        }
    }
}

fn default_config() -> gradacc_optimizer_config_t {
    let mut c = std::mem::MaybeUninit::uninit();
    // SAFETY: a writable config.
    assert_eq!(unsafe { gradacc_optimizer_config_default(c.as_mut_ptr()) }, GRADACC_STATUS_OK);
    // SAFETY: filled on success.
    unsafe { c.assume_init() }
}

/// A configuration, and whether the library must accept it (None: refused).
fn config(input: &mut Input) -> (gradacc_optimizer_config_t, Option<gradacc_optimizer_config_t>) {
    let defaults = default_config();
    let mut c = defaults;
    if !input.u8().is_multiple_of(4) {
        c.algorithm = GRADACC_OPTIMIZER_SGD;
        c.weight_decay = 0.0;
    }
    c.lr = [1e-3, 0.5, 0.0, 1.0, 2.5e-2][input.below(5)];
    if input.u8().is_multiple_of(4) {
        c.weight_decay = [0.0, 0.01, 0.5][input.below(3)];
    }
    if input.u8().is_multiple_of(4) {
        (c.momentum, c.dampening, c.nesterov) =
            [(0.9, 0.0, true), (0.5, 0.25, false), (0.0, 1.0, false)][input.below(3)];
    }
    if input.u8().is_multiple_of(4) {
        c.rounding = GRADACC_ROUNDING_STOCHASTIC;
        c.seed = input.u64();
    }
    // One field pushed out of its domain, or not when the pick happens to be valid.
    match input.u8() % 16 {
        0 => c.struct_size = input.u8() as usize,
        1 => c.algorithm = [2, -1, i32::MAX][input.below(3)],
        2 => c.lr = [-1.0, f32::NAN, f32::INFINITY, -0.0][input.below(4)],
        3 => c.beta1 = [1.0, -0.1, f32::NAN, 0.0][input.below(4)],
        4 => c.beta2 = [1.0, 1.5, f32::NEG_INFINITY, 0.0][input.below(4)],
        5 => c.eps = [0.0, -1e-8, f32::INFINITY, f32::MIN_POSITIVE][input.below(4)],
        6 => c.weight_decay = [-0.01, f32::NAN, f32::INFINITY][input.below(3)],
        7 => c.momentum = [-0.5, f32::NAN, f32::INFINITY, 0.0][input.below(4)],
        8 => c.dampening = [-0.5, 1.5, f32::NAN, 1.0][input.below(4)],
        9 => c.nesterov = true,
        10 => c.rounding = [2, -1][input.below(2)],
        _ => {}
    }
    let ends = field_ends!(gradacc_optimizer_config_t: struct_size, algorithm, lr, beta1, beta2,
        eps, weight_decay, momentum, dampening, nesterov, rounding, seed, masters, moments,
        moment_seed, weight_formats);
    let read = config_as_read(&c, &defaults, &ends).filter(config_valid);
    (c, read)
}

/// OptimizerConfig::validate and config_from_c, from the header's contract.
fn config_valid(c: &gradacc_optimizer_config_t) -> bool {
    let finite = |v: f32, ok: bool| ok && v.is_finite();
    let algorithm = match c.algorithm {
        GRADACC_OPTIMIZER_ADAMW => {
            finite(c.beta1, (0.0..1.0).contains(&c.beta1))
                && finite(c.beta2, (0.0..1.0).contains(&c.beta2))
                && finite(c.eps, c.eps > 0.0)
                && finite(c.weight_decay, c.weight_decay >= 0.0)
        }
        GRADACC_OPTIMIZER_SGD => {
            finite(c.momentum, c.momentum >= 0.0)
                && finite(c.dampening, (0.0..=1.0).contains(&c.dampening))
                && finite(c.weight_decay, c.weight_decay >= 0.0)
                && (!c.nesterov || (c.momentum > 0.0 && c.dampening == 0.0))
        }
        _ => false,
    };
    algorithm
        && [GRADACC_ROUNDING_NEAREST_EVEN, GRADACC_ROUNDING_STOCHASTIC].contains(&c.rounding)
        && c.lr.is_finite()
        && c.lr >= 0.0
}

/// What a saved part must hold first: src/optimizer/saved.rs's identity, from the header's fields.
fn identity(c: &gradacc_optimizer_config_t, numels: &[usize], dtypes: &[i32]) -> Vec<u64> {
    let mut id = vec![numels.len() as u64];
    for (&n, &d) in numels.iter().zip(dtypes) {
        id.extend([n as u64, d as u64]);
    }
    let (code, params) = if c.algorithm == GRADACC_OPTIMIZER_ADAMW {
        (1, [c.beta1, c.beta2, c.eps, c.weight_decay])
    } else {
        (2 | (c.nesterov as u64) << 8, [c.momentum, c.dampening, 0.0, c.weight_decay])
    };
    id.push(code);
    id.extend(params.map(|p| p.to_bits() as u64));
    let stochastic = c.rounding == GRADACC_ROUNDING_STOCHASTIC;
    id.extend([stochastic as u64, if stochastic { c.seed } else { 0 }]);
    id
}

fn create(world: &mut World, input: &mut Input) {
    let (acc, ai) = world.acc_arg(input);
    let pass_null_config = input.u8().is_multiple_of(4);
    let (c, read) = if pass_null_config {
        // A NULL config means the defaults.
        (default_config(), Some(default_config()))
    } else {
        config(input)
    };
    let (numels, grad_dtypes) = match ai {
        Some(i) => (world.accs[i].numels.clone(), world.accs[i].dtypes.clone()),
        None => (vec![2], vec![GRADACC_DTYPE_F32]),
    };
    let n = numels.len();
    let mut args_ok = true;
    // Groups: none, or one per tensor with a learning-rate scale, valid or not.
    let groups: Vec<gradacc_tensor_group_t> = (0..n)
        .map(|_| gradacc_tensor_group_t {
            weight_decay: input.u8() & 1 == 0,
            lr_scale: match input.u8() % 16 {
                0 => {
                    args_ok = false;
                    [-1.0, f32::NAN, f32::INFINITY][input.below(3)]
                }
                k => [1.0, 0.5, 0.0, 2.0, 1.0][k as usize % 5],
            },
        })
        .collect();
    let null_groups = input.u8().is_multiple_of(2);
    if null_groups {
        args_ok = true;
    }
    // Weight dtypes: the gradients' (NULL), or a list of the caller's, valid or not.
    let null_dtypes = input.u8().is_multiple_of(2);
    let mut dtype_list: Vec<i32> = (0..n).map(|_| input.below(3) as i32).collect();
    if !null_dtypes && input.u8().is_multiple_of(16) {
        dtype_list[input.below(n)] = [3, -1][input.below(2)];
        args_ok = false;
    }
    let dtypes = if null_dtypes { grad_dtypes } else { dtype_list.clone() };
    let weights: Vec<Vec<u32>> = numels
        .iter()
        .zip(&dtypes)
        .map(|(&numel, &d)| {
            let g = make_grad(input, d.clamp(0, 2), numel, 1.0, false);
            g.storage
        })
        .collect();
    let mut ptrs: Vec<*const c_void> =
        weights.iter().map(|w| w.as_ptr() as *const c_void).collect();
    let (listed, n_arg, bent_ok) =
        bend_weights(input, &mut ptrs, null(), |p| p.cast::<u8>().wrapping_add(1).cast());
    let weights_ptr = if listed { ptrs.as_ptr() } else { null() };
    args_ok &= bent_ok;
    // Adopted masters (one in three): the flat layout over the range the accumulator holds (its
    // shard, as the library reports it), each f32 tensor's weights at its offset, a word spare
    // for a misaligned address; or NULL, misaligned or of the wrong length.
    let adopt = input.u8().is_multiple_of(3);
    let (start, len) = match ai {
        Some(i) => {
            let (mut start, mut len, mut data) = (0, 0, null_mut());
            // SAFETY: a live accumulator and three live out-pointers.
            let st = unsafe {
                gradacc_accumulator_shard(world.accs[i].handle, &mut start, &mut len, &mut data)
            };
            assert_eq!(st, GRADACC_STATUS_OK, "gradacc_accumulator_shard of a live accumulator");
            (start, len)
        }
        None => (0, 2),
    };
    let whole = ai.filter(|&i| (start, len) == (0, world.accs[i].total()));
    let offsets = whole.map(|i| world.accs[i].offsets.clone());
    let mut masters = vec![0f32; len + 1];
    for (t, &at) in offsets.iter().flatten().enumerate().take(n) {
        if dtypes[t] == GRADACC_DTYPE_F32 {
            masters[at..at + numels[t]].copy_from_slice(&f32s_of(&weights[t][..numels[t]]));
        }
    }
    let (mut masters_ptr, mut masters_len) = (masters.as_mut_ptr(), len);
    if adopt {
        match input.u8() % 16 {
            0 => masters_ptr = null_mut(),
            1 => {
                // SAFETY: one byte into the buffer, which holds a word more than the layout.
                masters_ptr = unsafe { (masters_ptr as *mut u8).add(1) as *mut f32 };
            }
            2 => masters_len = [0, len.wrapping_sub(1), len + 1, usize::MAX][input.below(4)],
            _ => {}
        }
        args_ok &= masters_ptr == masters.as_mut_ptr() && masters_len == len;
    }
    // Never let a wrong count read past an array: the count is checked first.
    let null_out = input.u8().is_multiple_of(16);
    let want = ai.is_some() && read.is_some() && args_ok && !null_out;
    if want && world.opts.len() >= MAX_OBJECTS {
        return;
    }
    let mut out: *mut gradacc_optimizer_t = 0x13 as *mut _;
    let (config_ptr, groups_ptr) = (
        if pass_null_config { null() } else { &c as *const _ },
        if null_groups { null() } else { groups.as_ptr() },
    );
    let dtypes_ptr = if null_dtypes { null() } else { dtype_list.as_ptr() };
    let out_ptr = if null_out { null_mut() } else { &mut out as *mut _ };
    // SAFETY: every non-null pointer holds what the header asks for, or a count the library
    // refuses before it reads; the weights stay alive during the call, and an adopted buffer of
    // `masters_len` floats outlives the optimizer (the model keeps it) or is refused unused.
    let (function, st) = unsafe {
        if adopt {
            let st = gradacc_optimizer_create_with_masters(
                acc,
                config_ptr,
                groups_ptr,
                weights_ptr,
                dtypes_ptr,
                n_arg,
                masters_ptr,
                masters_len,
                out_ptr,
            );
            ("gradacc_optimizer_create_with_masters", st)
        } else {
            let st = gradacc_optimizer_create(
                acc,
                config_ptr,
                groups_ptr,
                weights_ptr,
                dtypes_ptr,
                n_arg,
                out_ptr,
            );
            ("gradacc_optimizer_create", st)
        }
    };
    if !world.check(function, st, want) {
        assert_eq!(out as usize, 0x13, "{function} wrote its output on failure");
        return;
    }
    let c = read.unwrap();
    let plain_sgd = c.algorithm == GRADACC_OPTIMIZER_SGD && c.momentum == 0.0;
    let shadow = (plain_sgd && dtypes.iter().all(|&d| d == GRADACC_DTYPE_F32)).then(|| Shadow {
        master: weights.iter().zip(&numels).map(|(w, &k)| f32s_of(&w[..k])).collect(),
        decay: groups
            .iter()
            .map(|g| if null_groups || g.weight_decay { c.weight_decay } else { 0.0 })
            .collect(),
        lr_scale: groups.iter().map(|g| if null_groups { 1.0 } else { g.lr_scale }).collect(),
    });
    world.opts.push(OptModel {
        handle: out,
        acc,
        identity: identity(&c, &numels, &dtypes),
        numels,
        weights,
        second_moment: c.algorithm == GRADACC_OPTIMIZER_ADAMW,
        lr: c.lr,
        steps: 0,
        consumed: None,
        shadow,
        adopted: adopt.then_some((masters, offsets)),
    });
}

fn f32s_of(words: &[u32]) -> Vec<f32> {
    words.iter().map(|&b| f32::from_bits(b)).collect()
}

/// One way in twelve, a bad `weights` argument: a NULL list, a NULL weight, a misaligned one (one
/// byte into its buffer, which holds a word more than the tensor: `misalign`) or a wrong count.
/// Bends `ptrs` in place; returns whether the list is passed (else NULL), the count to pass, and
/// whether the arguments are valid.
fn bend_weights<P: Copy>(
    input: &mut Input,
    ptrs: &mut [P],
    null: P,
    misalign: impl Fn(P) -> P,
) -> (bool, usize, bool) {
    let n = ptrs.len();
    match input.u8() % 12 {
        0 => (false, n, false),
        1 => {
            ptrs[input.below(n)] = null;
            (true, n, false)
        }
        2 => {
            let t = input.below(n);
            ptrs[t] = misalign(ptrs[t]);
            (true, n, false)
        }
        3 => {
            let n_arg = [0, n - 1, n + 1, usize::MAX][input.below(4)];
            (true, n_arg, n_arg == n)
        }
        _ => (true, n, true),
    }
}

fn step(world: &mut World, input: &mut Input) {
    let (opt, oi) = world.opt_arg(input);
    // Mostly the optimizer's own accumulator, when it is alive.
    let own = oi.map(|i| world.opts[i].acc).filter(|a| !a.is_null());
    let (acc, ai) = match own {
        Some(h) if !input.u8().is_multiple_of(4) => {
            (h, world.accs.iter().position(|a| a.handle == h))
        }
        _ => world.acc_arg(input),
    };
    let (comm, comm_ok) = if input.u8().is_multiple_of(8) {
        let (c, ci) = world.comm_arg(input);
        (c, c.is_null() || ci.is_some())
    } else {
        (null_mut(), true)
    };
    let mut scratch: Vec<Vec<u32>> = vec![vec![0; 3]];
    let weights = oi.map_or(&mut scratch, |i| &mut world.opts[i].weights);
    let before = weights.clone();
    let mut ptrs: Vec<*mut c_void> = weights.iter_mut().map(|w| w.as_mut_ptr() as _).collect();
    let (listed, n_arg, args_ok) =
        bend_weights(input, &mut ptrs, null_mut(), |p| p.cast::<u8>().wrapping_add(1).cast());
    let weights_ptr = if listed { ptrs.as_ptr() } else { null() };
    let null_stepped = input.u8().is_multiple_of(8);
    let mut stepped = false;
    // SAFETY: as for create; the weights are the model's own buffers, lent for the call.
    let st = unsafe {
        gradacc_optimizer_step(
            opt,
            acc,
            weights_ptr,
            n_arg,
            comm,
            if null_stepped { null_mut() } else { &mut stepped },
        )
    };
    drop(ptrs);
    let handles_ok = oi.is_some() && ai.is_some() && comm_ok && args_ok;
    let ours = handles_ok && own == Some(acc);
    // The window to step from: synced, and not stepped from yet.
    let window = ai.and_then(|i| match world.accs[i].w.phase {
        Phase::Synced(found_inf) => Some((world.accs[i].syncs, found_inf)),
        _ => None,
    });
    let fresh = window.filter(|&(id, _)| oi.is_some_and(|o| world.opts[o].consumed != Some(id)));
    let ok = world.check("gradacc_optimizer_step", st, ours && fresh.is_some());
    if handles_ok && !ours {
        assert_eq!(st, GRADACC_STATUS_INVALID_ARGUMENT, "another accumulator: {}", last_error());
    } else if ours && !ok {
        assert_eq!(st, GRADACC_STATUS_WRONG_STATE, "no fresh window: {}", last_error());
    }
    let Some(o) = oi.filter(|_| ok) else {
        if let Some(o) = oi {
            assert!(world.opts[o].weights == before, "a refused step changed the weights");
        }
        return;
    };
    let (id, found_inf) = fresh.unwrap();
    if !null_stepped {
        assert_eq!(stepped, !found_inf, "out_stepped");
    }
    let a = &world.accs[ai.unwrap()];
    let m = &mut world.opts[o];
    m.consumed = Some(id);
    if found_inf {
        assert!(m.weights == before, "a skipped step changed the weights");
        return;
    }
    m.steps += 1;
    m.shadow_step(a);
    m.check_shadow();
    world.opt_steps += 1;
    if matches!((&m.shadow, &m.adopted), (Some(_), Some((_, Some(_))))) {
        world.adopted_steps += 1;
    }
}

fn set_lr(world: &mut World, input: &mut Input) {
    let (opt, oi) = world.opt_arg(input);
    let lr = match input.below(12) {
        0 => f32::NAN,
        1 => f32::INFINITY,
        2 => -1.0,
        3 => -f32::MIN_POSITIVE,
        4 => f32::NEG_INFINITY,
        5 => f32::from_bits(input.u64() as u32),
        6 => -0.0,
        7 => f32::MAX,
        k => [1e-3, 0.5, 0.0, 3.0][k - 8],
    };
    let valid = lr.is_finite() && lr >= 0.0;
    // SAFETY: any handle value is reported, never dereferenced.
    let st = unsafe { gradacc_optimizer_set_lr(opt, lr) };
    if world.check("gradacc_optimizer_set_lr", st, oi.is_some() && valid) {
        world.opts[oi.unwrap()].lr = lr;
    } else if oi.is_some() {
        assert_eq!(st, GRADACC_STATUS_INVALID_ARGUMENT, "set_lr({lr}): {}", last_error());
    }
}

fn queries(world: &mut World, input: &mut Input) {
    let (opt, oi) = world.opt_arg(input);
    let null_out = input.u8().is_multiple_of(8);
    if input.u8() & 1 == 0 {
        let mut v = 77u64;
        // SAFETY: a writable output or NULL.
        let st =
            unsafe { gradacc_optimizer_steps(opt, if null_out { null_mut() } else { &mut v }) };
        if world.check("gradacc_optimizer_steps", st, oi.is_some() && !null_out) {
            assert_eq!(v, world.opts[oi.unwrap()].steps, "steps");
        } else {
            assert_eq!(v, 77);
        }
    } else {
        // A CPU optimizer's learning rate is a host value: never a device address.
        let mut p = 0x3 as *mut c_void;
        // SAFETY: a writable output or NULL.
        let st = unsafe {
            gradacc_optimizer_lr_device_ptr(opt, if null_out { null_mut() } else { &mut p })
        };
        world.check("gradacc_optimizer_lr_device_ptr", st, false);
        if null_out {
            assert_eq!(st, GRADACC_STATUS_NULL_ARGUMENT, "{}", last_error());
        } else if oi.is_some() {
            assert_eq!(st, GRADACC_STATUS_DEVICE_MISMATCH, "{}", last_error());
        }
        assert_eq!(p as usize, 3, "gradacc_optimizer_lr_device_ptr wrote its output on failure");
    }
}

/// The optimizer's saved state, through the size query (None: a refused handle).
fn saved(opt: *mut gradacc_optimizer_t) -> Option<Vec<u8>> {
    let mut need = 0usize;
    // SAFETY: a NULL buffer asks for the size only.
    if unsafe { gradacc_optimizer_save(opt, null_mut(), 0, &mut need) } != GRADACC_STATUS_OK {
        return None;
    }
    let mut buf = vec![0u8; need];
    let mut len = 0usize;
    // SAFETY: the buffer holds `need` writable bytes.
    let st = unsafe { gradacc_optimizer_save(opt, buf.as_mut_ptr(), need, &mut len) };
    assert_eq!((st, len), (GRADACC_STATUS_OK, need), "{}", last_error());
    Some(buf)
}

fn save(world: &mut World, input: &mut Input) {
    let (opt, oi) = world.opt_arg(input);
    let mut need = 0usize;
    // SAFETY: a NULL buffer asks for the size only.
    let st = unsafe { gradacc_optimizer_save(opt, null_mut(), 0, &mut need) };
    if !world.check("gradacc_optimizer_save", st, oi.is_some()) {
        return;
    }
    let short = input.u8().is_multiple_of(8);
    let null_len = input.u8().is_multiple_of(16);
    let mut buf = vec![0u8; need];
    let mut len = 0usize;
    let capacity = if short { need - 1 } else { need };
    // SAFETY: the buffer holds at least `capacity` writable bytes.
    let st = unsafe {
        gradacc_optimizer_save(
            opt,
            buf.as_mut_ptr(),
            capacity,
            if null_len { null_mut() } else { &mut len },
        )
    };
    if !world.check("gradacc_optimizer_save", st, !short && !null_len) {
        return;
    }
    assert_eq!(len, need);
    let o = &world.opts[oi.unwrap()];
    let s = decode_parts(std::slice::from_ref(&buf), o).expect("the model refuses a saved state");
    assert_eq!((s.lr.to_bits(), s.steps), (o.lr.to_bits(), o.steps), "saved lr and steps");
    if let Some(shadow) = &o.shadow {
        for (t, (_, _, master)) in s.tensors.iter().enumerate() {
            let same =
                master.iter().zip(&shadow.master[t]).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "saved masters of tensor {t} differ from the model");
        }
    }
    world.opt_states.push(buf);
    if world.opt_states.len() > 6 {
        world.opt_states.remove(0);
    }
}

fn load(world: &mut World, input: &mut Input) {
    let (opt, oi) = world.opt_arg(input);
    let count = [1, 1, 1, 2, 0][input.below(5)];
    let mut parts: Vec<Vec<u8>> = (0..count)
        .map(|_| {
            if world.opt_states.is_empty() || input.u8().is_multiple_of(16) {
                (0..input.below(96)).map(|_| input.u8()).collect()
            } else {
                world.opt_states[input.below(world.opt_states.len())].clone()
            }
        })
        .collect();
    let damage = parts.first_mut().and_then(|p| mutate(input, p));
    let mut ptrs: Vec<*const u8> = parts.iter().map(|p| p.as_ptr()).collect();
    let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
    let mut args_ok = count > 0;
    let (mut parts_ptr, mut lens_ptr) = (ptrs.as_ptr(), lens.as_ptr());
    match input.u8() % 16 {
        0 => parts_ptr = null(),
        1 => lens_ptr = null(),
        2 if count > 0 => {
            ptrs[0] = null();
            parts_ptr = ptrs.as_ptr();
        }
        _ => {}
    }
    args_ok &= parts_ptr == ptrs.as_ptr() && lens_ptr == lens.as_ptr() && !ptrs.contains(&null());
    let before = oi.map(|_| saved(opt).expect("a live optimizer saves"));
    // SAFETY: `count` parts and lengths, each part its length's bytes, or NULL.
    let st = unsafe { gradacc_optimizer_load(opt, parts_ptr, lens_ptr, count) };
    let restored = oi
        .filter(|_| args_ok && damage != Some(usize::MAX))
        .and_then(|i| decode_parts(&parts, &world.opts[i]));
    if !world.check("gradacc_optimizer_load", st, restored.is_some()) {
        if let Some(before) = before {
            assert!(saved(opt).unwrap() == before, "a refused load changed the state");
        }
        return;
    }
    let s = restored.unwrap();
    let o = &mut world.opts[oi.unwrap()];
    (o.lr, o.steps, o.consumed) = (s.lr, s.steps, None);
    if let Some(shadow) = &mut o.shadow {
        shadow.master = s.tensors.into_iter().map(|(_, _, m)| m).collect();
    }
}
