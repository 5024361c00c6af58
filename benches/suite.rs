//! The Rust half of `scripts/bench`: gradacc's `add` and `sync` next to the memory-bandwidth floor
//! measured in the same process, written as JSON lines for `benches/python/report.py`.
//!
//! `cargo bench --bench suite -- --out FILE [--quick] [--only sweep,layout,overhead,overflow,telemetry,boundary]`
//!
//! - sweep: one flat tensor, 4K to 256M elements, f16/bf16/f32, 1 and 2 threads; gradacc's `add`
//!   and three floors with the same byte traffic, taking turns.
//! - layout: model layouts (a GPT-2-like stack of 148 tensors and a GPT-style stack of 500, at
//!   several widths), gradacc's `add` over one flat master against the plain fused loop over
//!   per-tensor masters and the triad over one flat buffer of the same bytes, taking turns.
//! - overhead: 1000 tensors of 1000 elements and of 1 element, through the Rust API and the C ABI;
//!   overhead = the call's time minus the floor's time for the same bytes.
//! - overflow: a model layout's micro-batch under `Overflow::DropMicrobatch` against the default
//!   `SkipStep`, through `add` (checked before it is added) and tensor by tensor (through the
//!   staging), taking turns.
//! - telemetry: `sync` of the GPT-style layout with `tensor_stats` against without, alone and over
//!   the in-process communicator with 2 ranks, taking turns.
//! - boundary: `sync` of 100M parameters over the in-process communicator with 2 ranks, deferred
//!   (one sync per K micro-batches), with and without clipping, against an all-reduce after every
//!   micro-batch and one bare all-reduce of the same bytes.

mod common;

use std::ffi::c_void;
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::Barrier;
use std::time::Instant;

use common::{floor, fused, interleaved, kind, AlignedF32, Stats, Turns, TRIAD_FACTOR};
use gradacc::comm::HostCollectives;
use gradacc::simd;
use gradacc::{
    Accumulator, AccumulatorConfig, Communicator, Dtype, Grad, LocalComm, Overflow, Scaler,
    ScalerConfig, Sharding, TensorDesc,
};
use gradacc_capi::*;

const MI: usize = 1 << 20;

struct Options {
    quick: bool,
    out: Option<std::fs::File>,
    only: Option<Vec<String>>,
    /// Timed rounds per measurement (after one untimed round).
    rounds: usize,
    /// Shortest timed sample, in seconds: short calls are repeated within a sample up to this.
    min_sample: f64,
}

impl Options {
    fn parse() -> Options {
        let mut o = Options { quick: false, out: None, only: None, rounds: 15, min_sample: 0.01 };
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            match a.as_str() {
                "--quick" => o.quick = true,
                "--out" => {
                    o.out = Some(
                        std::fs::File::create(args.next().expect("--out FILE"))
                            .expect("cannot create --out file"),
                    )
                }
                "--only" => {
                    o.only = Some(
                        args.next().expect("--only LIST").split(',').map(str::to_owned).collect(),
                    )
                }
                // `cargo bench` passes `--bench`; anything else is cargo's business too.
                _ => {}
            }
        }
        if o.quick {
            o.rounds = 5;
            o.min_sample = 0.002;
        }
        o
    }

    fn wants(&self, part: &str) -> bool {
        self.only.as_ref().is_none_or(|only| only.iter().any(|p| p == part))
    }

    /// Writes one result line: `fields` is a JSON object body, `times` each variant's seconds.
    /// One JSON line: the times of the variants, and `ratios`, each the round-by-round ratio of
    /// two of them (`"a/b"`, see [`common::Turns::ratio`]).
    fn record(
        &mut self,
        group: &str,
        fields: &str,
        times: &[(&str, Stats)],
        ratios: &[(&str, Stats)],
    ) {
        let mut line = format!("{{\"group\":\"{group}\",{fields}");
        for (key, entries) in [("times", times), ("ratios", ratios)] {
            let _ = write!(line, ",\"{key}\":{{");
            for (i, (name, s)) in entries.iter().enumerate() {
                let sep = if i > 0 { "," } else { "" };
                let _ = write!(
                    line,
                    "{sep}\"{name}\":{{\"median\":{:e},\"min\":{:e},\"max\":{:e},\"n\":{}}}",
                    s.median, s.min, s.max, s.n
                );
            }
            line.push('}');
        }
        line.push_str("}\n");
        if let Some(f) = &mut self.out {
            f.write_all(line.as_bytes()).expect("cannot write results");
        }
    }
}

fn main() {
    let mut o = Options::parse();
    let isa = simd::active_isa();
    println!(
        "gradacc benchmark suite: {} path, median of {} rounds{}",
        isa.name(),
        o.rounds,
        if o.quick { " (quick)" } else { "" }
    );
    o.record("machine", &format!("\"isa\":\"{}\",\"quick\":{}", isa.name(), o.quick), &[], &[]);

    let max = if o.quick { 16 * MI } else { 256 * MI };
    let models = models(o.quick);
    let largest = models.iter().map(|m| m.numels.iter().sum::<usize>()).max().unwrap_or(0);
    let needed = if o.wants("sweep") { max.max(largest) } else { largest.max(MI) };
    if o.wants("sweep") || o.wants("layout") || o.wants("overhead") || o.wants("overflow") {
        let t = Instant::now();
        let mut master = AlignedF32::new(needed);
        let (g32, g16, gb16) = common::gradients(needed);
        let flat = [
            (Dtype::F16, Grad::F16(&g16)),
            (Dtype::Bf16, Grad::Bf16(&gb16)),
            (Dtype::F32, Grad::F32(&g32)),
        ];
        println!(
            "buffers of {}M elements ready in {:.1} s",
            needed / MI,
            t.elapsed().as_secs_f64()
        );
        if o.wants("sweep") {
            sweep(&mut o, &mut master, &flat, max);
        }
        if o.wants("layout") {
            layouts(&mut o, &flat, &models);
        }
        if o.wants("overhead") {
            overhead(&mut o, &mut master, &flat);
        }
        if o.wants("overflow") {
            overflow(&mut o, &flat, &models);
        }
    }
    if o.wants("telemetry") {
        telemetry(&mut o, &models);
    }
    if o.wants("boundary") {
        let n = if o.quick { 16 * MI } else { 100_000_000 };
        boundary(&mut o, n);
    }
}

/// A GPT-style stack of 500 tensors, in parameter order: token (4096 x d) and position (512 x d)
/// embeddings, 31 blocks of 16 tensors (two LayerNorms, q/k/v/o projections with biases, a 4d
/// MLP), a final LayerNorm. d = 512 gives 100,084,224 elements; the largest tensors hold 1M, 310 of
/// them hold d or 4d. `benches/python/peer.py` builds the same list.
fn transformer(d: usize) -> Vec<usize> {
    let mut t = vec![4096 * d, 512 * d];
    for _ in 0..31 {
        t.extend([d, d]);
        for _ in 0..4 {
            t.extend([d * d, d]);
        }
        t.extend([d, d, 4 * d * d, 4 * d, 4 * d * d, d]);
    }
    t.extend([d, d]);
    t
}

/// A GPT-2-like stack of 148 tensors, in parameter order: token embedding (64·d x d: the
/// vocabulary grows with the width), position embedding (1024 x d), 12 blocks of [ln_1 weight and
/// bias; c_attn d x 3d and its bias; attn c_proj d x d and its bias; ln_2 weight and bias; c_fc
/// d x 4d and its bias; mlp c_proj 4d x d and its bias], ln_f weight and bias. 98 of the tensors
/// hold d to 4d elements; d = 64, 256, 512, 1024 give 927,616, 13,934,080, 55,131,136 and
/// 219,314,176 elements.
fn gpt2(d: usize) -> Vec<usize> {
    let mut t = vec![64 * d * d, 1024 * d];
    for _ in 0..12 {
        t.extend([d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]);
    }
    t.extend([d, d]);
    t
}

/// One model's tensor sizes, in parameter order.
struct Model {
    name: &'static str,
    d: usize,
    numels: Vec<usize>,
}

/// The layouts the `layout` part measures, smallest first within each. The transformer at
/// d = 512 (quick: 128) is the layout `benches/python/peer.py` measures PyTorch on.
fn models(quick: bool) -> Vec<Model> {
    let (g, t): (&[usize], &[usize]) =
        if quick { (&[64, 256], &[64, 128]) } else { (&[64, 256, 512, 1024], &[64, 256, 512]) };
    let gpt = g.iter().map(|&d| Model { name: "gpt2", d, numels: gpt2(d) });
    gpt.chain(t.iter().map(|&d| Model { name: "transformer", d, numels: transformer(d) })).collect()
}

fn dtype_name(d: Dtype) -> &'static str {
    d.name()
}

fn bytes_per_element(d: Dtype) -> usize {
    d.size() + 8
}

/// A raw view of the first `len` elements of `master`, for closures that take turns with an
/// accumulator holding the same buffer (never used at the same time).
fn view<'a>(ptr: *mut f32, len: usize) -> &'a mut [f32] {
    // SAFETY: callers pass a prefix of a live AlignedF32, and only one closure runs at a time.
    unsafe { std::slice::from_raw_parts_mut(ptr, len) }
}

fn scaler() -> Scaler {
    Scaler::new(ScalerConfig { init_scale: 1024.0, ..ScalerConfig::default() }).expect("scaler")
}

fn sweep(o: &mut Options, master: &mut AlignedF32, flat: &[(Dtype, Grad<'_>)], max: usize) {
    println!("\n## add, one flat tensor: ns/element (gradacc | triad floor | ratio)");
    let isa = simd::active_isa();
    let mp = master.slice().as_mut_ptr();
    let sizes: Vec<usize> =
        std::iter::successors(Some(4096usize), |s| Some(s * 4)).take_while(|&s| s <= max).collect();
    let scaler = scaler();
    for &(dtype, grad) in flat {
        for &len in &sizes {
            for threads in [1, 2] {
                let g = grad.slice(0, len);
                let config = AccumulatorConfig { threads, ..AccumulatorConfig::default() };
                // SAFETY: `mp` holds at least `len` f32 for the accumulator's lifetime.
                let acc = unsafe {
                    Accumulator::builder(&[TensorDesc { numel: len, dtype }])
                        .config(config)
                        .master_buffer(mp, len)
                        .build()
                }
                .expect("accumulator");
                let t = interleaved(
                    o.rounds,
                    o.min_sample,
                    &mut [
                        &mut || acc.add(&scaler, &[g], 1).expect("add"),
                        &mut || floor::<{ kind::COPY }>(isa, view(mp, len), g, threads),
                        &mut || floor::<{ kind::TRIAD }>(isa, view(mp, len), g, threads),
                        &mut || {
                            assert!(!fused(isa, &mut [view(mp, len)], &[g], TRIAD_FACTOR, threads))
                        },
                    ],
                );
                let best = t[3].median;
                println!(
                    "{:>6} {:>4} {}T  {:.3} | {:.3} | {:.2}",
                    size_label(len),
                    dtype_name(dtype),
                    threads,
                    t[0].median * 1e9 / len as f64,
                    best * 1e9 / len as f64,
                    t.ratio(0, 3).median
                );
                o.record(
                    "sweep",
                    &format!(
                        "\"numel\":{len},\"dtype\":\"{}\",\"threads\":{threads},\"bytes\":{}",
                        dtype_name(dtype),
                        len * bytes_per_element(dtype)
                    ),
                    &[("gradacc", t[0]), ("copy", t[1]), ("triad", t[2]), ("fused", t[3])],
                    &[("gradacc/fused", t.ratio(0, 3))],
                );
            }
        }
    }
}

fn size_label(n: usize) -> String {
    if n >= MI && n.is_multiple_of(MI) {
        format!("{}M", n / MI)
    } else if n >= 1024 && n.is_multiple_of(1024) {
        format!("{}K", n / 1024)
    } else {
        n.to_string()
    }
}

/// Separately allocated gradients, one per tensor, as a framework's `param.grad`s are.
enum Owned {
    F32(Vec<f32>),
    F16(Vec<half::f16>),
    Bf16(Vec<half::bf16>),
}

fn owned_grads(numels: &[usize], flat: Grad<'_>) -> Vec<Owned> {
    let mut start = 0;
    numels
        .iter()
        .map(|&n| {
            let s = start % (flat.len() - n + 1);
            start += n;
            match flat.slice(s, s + n) {
                Grad::F32(v) => Owned::F32(v.to_vec()),
                Grad::F16(v) => Owned::F16(v.to_vec()),
                Grad::Bf16(v) => Owned::Bf16(v.to_vec()),
            }
        })
        .collect()
}

fn views(owned: &[Owned]) -> Vec<Grad<'_>> {
    owned
        .iter()
        .map(|g| match g {
            Owned::F32(v) => Grad::F32(v),
            Owned::F16(v) => Grad::F16(v),
            Owned::Bf16(v) => Grad::Bf16(v),
        })
        .collect()
}

fn ptrs(owned: &[Owned]) -> Vec<*const c_void> {
    owned
        .iter()
        .map(|g| match g {
            Owned::F32(v) => v.as_ptr().cast(),
            Owned::F16(v) => v.as_ptr().cast(),
            Owned::Bf16(v) => v.as_ptr().cast(),
        })
        .collect()
}

/// Each model layout, dtype and thread count: gradacc's `add` over one flat master (the layout
/// `Accumulator::new` uses, in an adopted 64-byte-aligned buffer), the plain fused loop over
/// per-tensor masters allocated one by one (as a user's own parameters are), and the triad over
/// the flat master; all three read
/// the same separately allocated gradients (the triad a flat one), taking turns. The flat master
/// is allocated with the per-tensor ones, for each model, so that both sides get their memory in
/// the same state of the machine: a buffer allocated at another time can land in slower memory
/// (with 16-bit gradients, one run had the triad over the suite's shared buffer up to 10% slower
/// than the per-tensor loop from DRAM, the next up to 12% faster).
fn layouts(o: &mut Options, flat: &[(Dtype, Grad<'_>)], models: &[Model]) {
    println!("\n## add, model layouts: ms (gradacc | plain fused loop, per tensor | triad, flat | gradacc / plain fused)");
    let isa = simd::active_isa();
    let scaler = scaler();
    for model in models {
        let numels = &model.numels;
        let total: usize = numels.iter().sum();
        // The largest layouts take a second or more a round per variant: fewer rounds keep the
        // full run within its time.
        let rounds = if total > 128 * MI {
            o.rounds.min(7)
        } else if total > 32 * MI {
            o.rounds.min(9)
        } else {
            o.rounds
        };
        println!("{} d = {}: {} tensors, {} elements", model.name, model.d, numels.len(), total);
        let mut own: Vec<AlignedF32> = numels.iter().map(|&n| AlignedF32::new(n)).collect();
        let mut masters: Vec<&mut [f32]> = own.iter_mut().map(AlignedF32::slice).collect();
        let descs =
            |dtype| numels.iter().map(|&numel| TensorDesc { numel, dtype }).collect::<Vec<_>>();
        // Each tensor starts at a multiple of MASTER_ALIGN bytes: the master is a little longer.
        let master_len = Accumulator::master_len(&descs(Dtype::F32)).expect("a layout");
        let mut master = AlignedF32::new(master_len);
        let mp = master.slice().as_mut_ptr();
        for &(dtype, grad) in flat {
            let owned = owned_grads(numels, grad);
            let grads = views(&owned);
            let g = grad.slice(0, total);
            for threads in [1, 2] {
                let config = AccumulatorConfig { threads, ..AccumulatorConfig::default() };
                // SAFETY: `mp` holds `master_len` f32 for the accumulator's lifetime.
                let acc = unsafe {
                    Accumulator::builder(&descs(dtype))
                        .config(config)
                        .master_buffer(mp, master_len)
                        .build()
                }
                .expect("accumulator");
                let t = interleaved(
                    rounds,
                    o.min_sample,
                    &mut [
                        &mut || acc.add(&scaler, &grads, 1).expect("add"),
                        &mut || assert!(!fused(isa, &mut masters, &grads, TRIAD_FACTOR, threads)),
                        &mut || floor::<{ kind::TRIAD }>(isa, view(mp, total), g, threads),
                    ],
                );
                println!(
                    "{:>4} {}T  {:.2} | {:.2} | {:.2} | {:.2}",
                    dtype_name(dtype),
                    threads,
                    t[0].median * 1e3,
                    t[1].median * 1e3,
                    t[2].median * 1e3,
                    t.ratio(0, 1).median
                );
                o.record(
                    "layout",
                    &format!(
                        "\"layout\":\"{}\",\"d\":{},\"tensors\":{},\"numel\":{total},\"dtype\":\"{}\",\"threads\":{threads},\"bytes\":{}",
                        model.name,
                        model.d,
                        numels.len(),
                        dtype_name(dtype),
                        total * bytes_per_element(dtype)
                    ),
                    &[("gradacc", t[0]), ("fused", t[1]), ("triad", t[2])],
                    &[("gradacc/fused", t.ratio(0, 1))],
                );
            }
        }
    }
}

/// What dropping a poisoned micro-batch costs a clean one: `add` and a hook micro-batch (begin,
/// one `add_tensor` per tensor in the backward's order, end) under `DropMicrobatch` against the
/// same under `SkipStep`, on each model layout's largest width, 1 thread.
fn overflow(o: &mut Options, flat: &[(Dtype, Grad<'_>)], models: &[Model]) {
    println!("\n## DropMicrobatch on a clean micro-batch, 1 thread: ms (SkipStep | DropMicrobatch | ratio), add then hooks");
    let scaler = scaler();
    for model in models.iter().filter(|m| models.iter().all(|n| n.name != m.name || n.d <= m.d)) {
        let numels = &model.numels;
        let total: usize = numels.iter().sum();
        println!("{} d = {}: {} tensors, {} elements", model.name, model.d, numels.len(), total);
        for &(dtype, grad) in flat.iter().filter(|(d, _)| *d != Dtype::F32) {
            let owned = owned_grads(numels, grad);
            let grads = views(&owned);
            let descs: Vec<TensorDesc> =
                numels.iter().map(|&numel| TensorDesc { numel, dtype }).collect();
            let make = |overflow| {
                let config = AccumulatorConfig { overflow, ..AccumulatorConfig::default() };
                Accumulator::new(config, &descs).expect("accumulator")
            };
            let (skip, drop) = (make(Overflow::SkipStep), make(Overflow::DropMicrobatch));
            let hooks = |acc: &Accumulator| {
                acc.begin_microbatch(1).expect("begin");
                for (i, &g) in grads.iter().enumerate().rev() {
                    acc.add_tensor(&scaler, i, g).expect("add_tensor");
                }
                acc.end_microbatch().expect("end");
            };
            let t = interleaved(
                o.rounds.min(9),
                o.min_sample,
                &mut [
                    &mut || skip.add(&scaler, &grads, 1).expect("add"),
                    &mut || drop.add(&scaler, &grads, 1).expect("add"),
                    &mut || hooks(&skip),
                    &mut || hooks(&drop),
                ],
            );
            let ms = |i: usize| t[i].median * 1e3;
            println!(
                "{:>4} add {:.2} | {:.2} | {:.2}   hooks {:.2} | {:.2} | {:.2}",
                dtype_name(dtype),
                ms(0),
                ms(1),
                t.ratio(1, 0).median,
                ms(2),
                ms(3),
                t.ratio(3, 2).median
            );
            o.record(
                "overflow",
                &format!(
                    "\"layout\":\"{}\",\"d\":{},\"tensors\":{},\"numel\":{total},\"dtype\":\"{}\",\"threads\":1",
                    model.name,
                    model.d,
                    numels.len(),
                    dtype_name(dtype)
                ),
                &[("add", t[0]), ("add_drop", t[1]), ("hooks", t[2]), ("hooks_drop", t[3])],
                &[("add_drop/add", t.ratio(1, 0)), ("hooks_drop/hooks", t.ratio(3, 2))],
            );
        }
    }
}

/// Per-call cost of many small tensors, through the Rust API and through the C ABI (what every
/// binding calls), against the floor for the same bytes in the same (cache-resident) state.
fn overhead(o: &mut Options, master: &mut AlignedF32, flat: &[(Dtype, Grad<'_>)]) {
    println!("\n## per-call overhead, 1 thread: us per call (Rust API | C ABI | triad floor, flat | overhead over the floor)");
    let isa = simd::active_isa();
    let capacity = master.slice().len();
    let mp = master.slice().as_mut_ptr();
    let scaler = scaler();
    let mut c_scaler: *mut gradacc_scaler_t = std::ptr::null_mut();
    // SAFETY: a plain C struct of numbers and bools, filled in by the default initialiser next.
    let mut sc: gradacc_scaler_config_t = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { gradacc_scaler_config_default(&mut sc) }, GRADACC_STATUS_OK);
    sc.init_scale = 1024.0;
    assert_eq!(
        unsafe { gradacc_scaler_create(&sc, std::ptr::null(), &mut c_scaler) },
        GRADACC_STATUS_OK
    );
    for &(dtype, grad) in flat.iter().filter(|(d, _)| *d != Dtype::Bf16) {
        for (tensors, numel) in [(1000usize, 1000usize), (1000, 1), (1, 1_000_000)] {
            let layout = vec![numel; tensors];
            let total = tensors * numel;
            let owned = owned_grads(&layout, grad);
            let grads = views(&owned);
            let raw = ptrs(&owned);
            let g = grad.slice(0, total);
            let descs: Vec<TensorDesc> =
                layout.iter().map(|&numel| TensorDesc { numel, dtype }).collect();
            let master_len = Accumulator::master_len(&descs).expect("a layout");
            assert!(master_len <= capacity, "the suite's master is too short");
            // SAFETY: `mp` holds at least `master_len` f32; the two accumulators take turns.
            let acc = unsafe { Accumulator::builder(&descs).master_buffer(mp, master_len).build() }
                .expect("accumulator");
            let c_descs: Vec<gradacc_tensor_desc_t> = layout
                .iter()
                .map(|&n| gradacc_tensor_desc_t {
                    numel: n as u64,
                    dtype: match dtype {
                        Dtype::F32 => GRADACC_DTYPE_F32,
                        Dtype::F16 => GRADACC_DTYPE_F16,
                        Dtype::Bf16 => GRADACC_DTYPE_BF16,
                    },
                })
                .collect();
            let mut c_acc: *mut gradacc_accumulator_t = std::ptr::null_mut();
            let status = unsafe {
                gradacc_accumulator_create_with_buffer(
                    std::ptr::null(),
                    c_descs.as_ptr(),
                    tensors,
                    std::ptr::null(),
                    mp,
                    master_len,
                    &mut c_acc,
                )
            };
            assert_eq!(status, GRADACC_STATUS_OK);
            let t = interleaved(
                o.rounds,
                o.min_sample,
                &mut [
                    &mut || acc.add(&scaler, &grads, 1).expect("add"),
                    &mut || {
                        assert_eq!(
                            unsafe {
                                gradacc_accumulator_add(c_acc, c_scaler, raw.as_ptr(), tensors, 1)
                            },
                            GRADACC_STATUS_OK
                        )
                    },
                    &mut || floor::<{ kind::TRIAD }>(isa, view(mp, total), g, 1),
                    &mut || assert!(!fused(isa, &mut [view(mp, total)], &[g], TRIAD_FACTOR, 1)),
                ],
            );
            assert_eq!(unsafe { gradacc_accumulator_destroy(c_acc) }, GRADACC_STATUS_OK);
            let best = t[3].median;
            println!(
                "{tensors:>5} x {numel:<7} {:>4}  {:.2} | {:.2} | {:.2} | {:.2}",
                dtype_name(dtype),
                t[0].median * 1e6,
                t[1].median * 1e6,
                best * 1e6,
                (t[1].median - best) * 1e6
            );
            o.record(
                "overhead",
                &format!(
                    "\"tensors\":{tensors},\"numel\":{numel},\"dtype\":\"{}\",\"threads\":1,\"bytes\":{}",
                    dtype_name(dtype),
                    total * bytes_per_element(dtype)
                ),
                &[("rust_api", t[0]), ("c_abi", t[1]), ("triad", t[2]), ("fused", t[3])],
                &[],
            );
        }
    }
    assert_eq!(unsafe { gradacc_scaler_destroy(c_scaler) }, GRADACC_STATUS_OK);
}

/// The boundary at 2 in-process ranks (one thread each) over `n` fp16 parameters in one tensor, as
/// `benches/mpi_boundary.c` does over MPI: K micro-batches per step, then
///   deferred: `sync` (control reduction, all-reduce of the FP32 master, normalisation, norm);
///   clipped:  the same with `max_grad_norm` below the norm, so clipping applies (its accumulator
///             gets one micro-batch per step: `sync`'s work does not depend on K);
///   scatter:  the same `sync` as a reduce-scatter (`Sharding::ReduceScatter`): each rank ends with
///             only its shard (one micro-batch per step, as clipped);
///   naive:    an all-reduce of an FP32 gradient of the same size after every micro-batch;
///   bare:     one all-reduce of the same bytes, nothing else.
/// The adds are the same in both patterns and not timed; each time is the slowest rank's.
/// What `tensor_stats` costs a boundary: the largest GPT-style layout, one micro-batch per window,
/// synced without and with it in turns, by one process and by 2 in-process ranks (each round's
/// time is its slower rank's), clipping on (the norm's second step).
fn telemetry(o: &mut Options, models: &[Model]) {
    let Some(model) = models.iter().filter(|m| m.name == "transformer").max_by_key(|m| m.d) else {
        return;
    };
    let numels = &model.numels;
    let total: usize = numels.iter().sum();
    println!(
        "\n## tensor_stats at the boundary, {} d = {} ({} tensors, {total} fp16 elements): ms (off | on | on / off)",
        model.name,
        model.d,
        numels.len()
    );
    let descs: Vec<TensorDesc> =
        numels.iter().map(|&numel| TensorDesc { numel, dtype: Dtype::F16 }).collect();
    let rounds = o.rounds.min(9);
    for ranks in [1usize, 2] {
        let comms = LocalComm::group(ranks).expect("group");
        let barrier = Barrier::new(ranks);
        let per_rank: Vec<Vec<[f64; 2]>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter()
                .map(|comm| {
                    let (barrier, descs) = (&barrier, &descs);
                    s.spawn(move || {
                        let (_, g16, _) = common::gradients(total);
                        let owned = owned_grads(numels, Grad::F16(&g16));
                        let grads = views(&owned);
                        let make = |tensor_stats| {
                            let config = AccumulatorConfig {
                                max_grad_norm: 1e-3,
                                tensor_stats,
                                ..AccumulatorConfig::default()
                            };
                            Accumulator::new(config, descs).expect("accumulator")
                        };
                        let (off, on) = (make(false), make(true));
                        let scaler = scaler();
                        let comm = (ranks > 1).then_some(comm as &dyn Communicator);
                        let mut times = Vec::new();
                        for round in 0..=rounds {
                            let mut t = [0.0; 2];
                            for (i, acc) in [&off, &on].into_iter().enumerate() {
                                acc.add(&scaler, &grads, 1).expect("add");
                                barrier.wait();
                                let start = Instant::now();
                                acc.sync(comm).expect("sync");
                                t[i] = start.elapsed().as_secs_f64();
                            }
                            if round > 0 {
                                times.push(t);
                            }
                        }
                        times
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        let rows: Vec<[f64; 2]> = (0..rounds)
            .map(|r| std::array::from_fn(|i| per_rank.iter().map(|t| t[r][i]).fold(0.0, f64::max)))
            .collect();
        let t = Turns::new((0..2).map(|i| rows.iter().map(|r| r[i]).collect()).collect());
        println!(
            "{ranks} rank{}: {:.1} | {:.1} | {:.3}",
            if ranks > 1 { "s" } else { "" },
            t[0].median * 1e3,
            t[1].median * 1e3,
            t.ratio(1, 0).median
        );
        o.record(
            "telemetry",
            &format!(
                "\"layout\":\"{}\",\"d\":{},\"tensors\":{},\"numel\":{total},\"ranks\":{ranks}",
                model.name,
                model.d,
                numels.len()
            ),
            &[("off", t[0]), ("on", t[1])],
            &[("on/off", t.ratio(1, 0))],
        );
    }
}

fn boundary(o: &mut Options, n: usize) {
    println!(
        "\n## boundary, in-process communicator, 2 ranks, {} fp16 parameters: ms (deferred sync | clipped sync | reduce-scatter sync | naive K all-reduces | bare all-reduce)",
        n
    );
    let comms = LocalComm::group(2).expect("group");
    let rounds = o.rounds;
    let barrier = Barrier::new(2);
    let whole = 0..n;
    let bucket = std::slice::from_ref(&whole);
    let results: Vec<Vec<(usize, [f64; 5])>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                let barrier = &barrier;
                s.spawn(move || {
                    let (_, g16, _) = common::gradients(n);
                    let desc = [TensorDesc { numel: n, dtype: Dtype::F16 }];
                    let acc =
                        Accumulator::new(AccumulatorConfig::default(), &desc).expect("accumulator");
                    // The gradients, in [-0.5, 0.5) unscaled by 1024, make a norm of about 2.8e-4
                    // per sqrt(element): over 1 at 16M elements, so 1e-3 clips at any size here.
                    let clip_config =
                        AccumulatorConfig { max_grad_norm: 1e-3, ..AccumulatorConfig::default() };
                    let clip = Accumulator::new(clip_config, &desc).expect("accumulator");
                    let sharding = Sharding::ReduceScatter { shards: 2, rank: comm.rank() };
                    let scatter = Accumulator::new(
                        AccumulatorConfig { sharding, ..AccumulatorConfig::default() },
                        &desc,
                    )
                    .expect("accumulator");
                    let scaler = scaler();
                    let mut plain = vec![1.0f32; n];
                    let timed = |f: &mut dyn FnMut()| {
                        barrier.wait();
                        let t = Instant::now();
                        f();
                        t.elapsed().as_secs_f64()
                    };
                    let mut out = Vec::new();
                    for k in [1usize, 4, 8] {
                        let mut times = Vec::new();
                        for round in 0..=rounds {
                            for _ in 0..k {
                                acc.add(&scaler, &[Grad::F16(&g16)], 1).expect("add");
                            }
                            clip.add(&scaler, &[Grad::F16(&g16)], 1).expect("add");
                            scatter.add(&scaler, &[Grad::F16(&g16)], 1).expect("add");
                            let d = timed(&mut || {
                                acc.sync(Some(comm as &dyn Communicator)).expect("sync");
                            });
                            let mut info = None;
                            let c = timed(&mut || {
                                info =
                                    Some(clip.sync(Some(comm as &dyn Communicator)).expect("sync"))
                            });
                            let info = info.expect("sync info");
                            assert!(
                                info.clip_coef < 1.0,
                                "clipping did not apply (norm {})",
                                info.grad_norm
                            );
                            let r = timed(&mut || {
                                scatter.sync(Some(comm as &dyn Communicator)).expect("sync");
                            });
                            let nv = timed(&mut || {
                                for _ in 0..k {
                                    comm.allreduce_buckets(&mut plain, bucket).expect("all-reduce");
                                }
                            });
                            let b = timed(&mut || {
                                comm.allreduce_buckets(&mut plain, bucket).expect("all-reduce")
                            });
                            plain.fill(1.0); // keep the values finite
                            if round > 0 {
                                times.push([d, c, r, nv, b]);
                            }
                        }
                        out.push((k, times));
                    }
                    out.into_iter()
                        .flat_map(|(k, times)| times.into_iter().map(move |t| (k, t)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    for k in [1usize, 4, 8] {
        // Each round's time is its slowest rank's.
        let rows: Vec<[f64; 5]> = results[0]
            .iter()
            .zip(&results[1])
            .filter(|((k0, _), _)| *k0 == k)
            .map(|((_, a), (_, b))| std::array::from_fn(|i| a[i].max(b[i])))
            .collect();
        let t = Turns::new((0..5).map(|i| rows.iter().map(|r| r[i]).collect()).collect());
        let (d, c, r, nv, b) = (t[0], t[1], t[2], t[3], t[4]);
        let (d_b, c_b, r_d) = (t.ratio(0, 4), t.ratio(1, 4), t.ratio(2, 0));
        println!(
            "K = {k}: {:.1} | {:.1} | {:.1} | {:.1} | {:.1}  (sync / bare {:.2}, clipped / bare {:.2}, reduce-scatter / sync {:.2})",
            d.median * 1e3,
            c.median * 1e3,
            r.median * 1e3,
            nv.median * 1e3,
            b.median * 1e3,
            d_b.median,
            c_b.median,
            r_d.median
        );
        o.record(
            "boundary_local",
            &format!(
                "\"ranks\":2,\"numel\":{n},\"dtype\":\"f16\",\"k\":{k},\"max_grad_norm\":1e-3"
            ),
            &[("deferred", d), ("clipped", c), ("reduce_scatter", r), ("naive", nv), ("bare", b)],
            &[("deferred/bare", d_b), ("clipped/bare", c_b), ("reduce_scatter/deferred", r_d)],
        );
    }
}
