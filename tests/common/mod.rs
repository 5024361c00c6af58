//! Helpers shared by the integration tests: a seeded PRNG whose seed is fresh each run (printed,
//! and overridable with GRADACC_TEST_SEED), and 16-bit encoders from the `half` crate, so the
//! references never reuse the library's own conversions.
#![allow(dead_code)]

pub mod cuda;
pub mod cuda_optimizer;
pub mod mesh_model;
pub mod mpirun;
pub mod step_reference;
pub mod weights;

pub struct Rng(u64);

impl Rng {
    /// A generator seeded from the clock unless GRADACC_TEST_SEED is set; prints the seed.
    pub fn fresh(test: &str) -> Rng {
        let seed = std::env::var("GRADACC_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        eprintln!("{test}: GRADACC_TEST_SEED={seed}");
        Rng(seed)
    }

    /// A generator with a given seed (e.g. one drawn from a fresh generator, to replay a stream).
    pub fn seeded(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }

    /// Uniform integer in [lo, hi].
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// One to six tensors of odd and even sizes and every dtype.
pub fn random_tensors(rng: &mut Rng) -> Vec<gradacc::TensorDesc> {
    let sizes = [1usize, 2, 7, 33, 1000, 4097];
    let dtypes = [gradacc::Dtype::F32, gradacc::Dtype::F16, gradacc::Dtype::Bf16];
    (0..rng.range(1, 6))
        .map(|_| gradacc::TensorDesc {
            numel: sizes[rng.range(0, 5) as usize],
            dtype: dtypes[rng.range(0, 2) as usize],
        })
        .collect()
}

/// A boundary of random settings: loss reduction, normalisation, clipping (a third of the time
/// off), bucket size and threads; the rest default.
pub fn random_config(rng: &mut Rng) -> gradacc::AccumulatorConfig {
    use gradacc::{LossReduction, Normalize};
    gradacc::AccumulatorConfig {
        loss_reduction: if rng.range(0, 1) == 0 { LossReduction::Mean } else { LossReduction::Sum },
        normalize: [
            Normalize::ByCount,
            Normalize::ByMicrobatches,
            Normalize::ByWorld,
            Normalize::None,
        ][rng.range(0, 3) as usize],
        max_grad_norm: if rng.range(0, 2) == 0 { rng.uniform(0.01, 2.0) as f32 } else { 0.0 },
        bucket_numel: rng.range(1, 6000) as usize,
        threads: rng.range(1, 3) as usize,
        ..Default::default()
    }
}

/// Runs `f(g, shard group, replica group)` on every rank `g` of a grid of `replicas` groups of
/// `shards` ranks (in-process), each on its own thread: rank g is replica `g / shards` of shard
/// `g % shards`.
pub fn hybrid_grid<T: Send>(
    shards: usize,
    replicas: usize,
    f: impl Fn(usize, &gradacc::LocalComm, &gradacc::LocalComm) -> T + Sync,
) -> Vec<T> {
    let shard_groups: Vec<Vec<gradacc::LocalComm>> =
        (0..replicas).map(|_| gradacc::LocalComm::group(shards).unwrap()).collect();
    let replica_groups: Vec<Vec<gradacc::LocalComm>> =
        (0..shards).map(|_| gradacc::LocalComm::group(replicas).unwrap()).collect();
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..shards * replicas)
            .map(|g| {
                let (a, i) = (g / shards, g % shards);
                let (sc, rc) = (&shard_groups[a][i], &replica_groups[i][a]);
                s.spawn(move || f(g, sc, rc))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A gradient of `dtype` over the buffer that holds it: `f32s` for F32, the 16-bit bits otherwise.
pub fn grad_of<'a>(dtype: gradacc::Dtype, f32s: &'a [f32], halves: &'a [u16]) -> gradacc::Grad<'a> {
    match dtype {
        gradacc::Dtype::F32 => gradacc::Grad::F32(f32s),
        gradacc::Dtype::F16 => gradacc::Grad::f16_bits(halves),
        gradacc::Dtype::Bf16 => gradacc::Grad::bf16_bits(halves),
    }
}

/// `values` times `scale`, as the buffer of `dtype` holds them: f32s, or 16-bit bits.
pub fn encode(dtype: gradacc::Dtype, values: &[f32], scale: f32) -> (Vec<f32>, Vec<u16>) {
    match dtype {
        gradacc::Dtype::F32 => (values.iter().map(|v| v * scale).collect(), vec![]),
        gradacc::Dtype::F16 => (vec![], values.iter().map(|v| to_f16(v * scale)).collect()),
        gradacc::Dtype::Bf16 => (vec![], values.iter().map(|v| to_bf16(v * scale)).collect()),
    }
}

/// The value the library sees for one element, decoded independently, in f64 and unscaled.
pub fn decoded(dtype: gradacc::Dtype, v: f32, scale: f32) -> f64 {
    let scaled = v * scale;
    let d = match dtype {
        gradacc::Dtype::F32 => scaled as f64,
        gradacc::Dtype::F16 => from_f16(to_f16(scaled)),
        gradacc::Dtype::Bf16 => from_bf16(to_bf16(scaled)),
    };
    d / scale as f64
}

pub fn to_f16(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

pub fn to_bf16(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

pub fn from_f16(b: u16) -> f64 {
    half::f16::from_bits(b).to_f64()
}

pub fn from_bf16(b: u16) -> f64 {
    half::bf16::from_bits(b).to_f64()
}

/// Rounds of `threads` workers racing: in each round `open(round)` runs, then every worker runs
/// `work(worker, round)` at once (released together), then `check(round)`, which ends the rounds
/// with its message when something is wrong. No worker is left waiting when a check fails.
pub fn race_rounds(
    threads: usize,
    rounds: usize,
    open: impl Fn(usize),
    work: impl Fn(usize, usize) + Sync,
    mut check: impl FnMut(usize) -> Option<String>,
) -> Option<String> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Barrier;
    let (start, done) = (Barrier::new(threads + 1), Barrier::new(threads + 1));
    // The workers leave at the start of round `last`, so a failed check never strands one.
    let last = AtomicUsize::new(rounds);
    std::thread::scope(|sc| {
        for worker in 0..threads {
            let (start, done, last, work) = (&start, &done, &last, &work);
            sc.spawn(move || {
                for round in 0.. {
                    start.wait();
                    if round >= last.load(Ordering::Acquire) {
                        return;
                    }
                    work(worker, round);
                    done.wait();
                }
            });
        }
        let mut failed = None;
        for round in 0..rounds {
            open(round);
            start.wait();
            done.wait();
            failed = check(round);
            if failed.is_some() {
                last.store(round + 1, Ordering::Release);
                break;
            }
        }
        start.wait();
        failed
    })
}

/// The layout of [`check_overlapping_gradients`]: two f32 tensors of equal size, so one's master
/// can pose as the other's gradient, and an f16 one.
pub const OVERLAP_TENSORS: [gradacc::TensorDesc; 3] = [
    gradacc::TensorDesc { numel: 8192, dtype: gradacc::Dtype::F32 },
    gradacc::TensorDesc { numel: 8192, dtype: gradacc::Dtype::F32 },
    gradacc::TensorDesc { numel: 50, dtype: gradacc::Dtype::F16 },
];

/// Elements of backing memory on either side of the adopted master in
/// [`check_overlapping_gradients`].
pub const OVERLAP_MARGIN: usize = 16_500;

/// Gradients that share memory with the master, on any device: `acc` adopted a master of
/// [`OVERLAP_TENSORS`] at element [`OVERLAP_MARGIN`] of backing memory at `base` (f32 values `i`
/// at element `i`, 2 × margin + the master long; a device address on CUDA), `others` are
/// gradients of tensors 0 and 2 elsewhere, `read_master` reads the whole master and
/// `read_backing(at, n)` `n` f32 of the backing memory. Tensor 1's gradient at every shift from
/// its own master that overlaps the master (its own and tensor 0's master exactly included), and
/// a few beyond, through `add` and `add_tensor` in turn: an overlap is refused with
/// INVALID_ARGUMENT and changes nothing, and a gradient beside the master is added as any other.
/// Returns how many shifts it tried.
pub fn check_overlapping_gradients(
    acc: &gradacc::Accumulator,
    scaler: &gradacc::Scaler,
    base: usize,
    others: [usize; 2],
    read_master: &dyn Fn() -> Vec<f32>,
    read_backing: &dyn Fn(usize, usize) -> Vec<f32>,
) -> usize {
    use std::ffi::c_void;
    let scale = scaler.scale().unwrap();
    // The whole master, padding included, is the caller's adopted buffer: no gradient may
    // overlap any of it.
    let len = acc.len();
    assert_eq!(len, gradacc::Accumulator::master_len(&OVERLAP_TENSORS).unwrap());
    let own = acc.offset(1).unwrap();
    let numel = OVERLAP_TENSORS[1].numel;
    let at = |shift: isize| (OVERLAP_MARGIN + own).checked_add_signed(shift).unwrap();
    let mut tried = 0;
    for shift in -(own as isize + numel as isize + 116)..=(len - own) as isize + 58 {
        let start = at(shift);
        let overlaps = start < OVERLAP_MARGIN + len && start + numel > OVERLAP_MARGIN;
        tried += 1;
        let grad = (base + 4 * start) as *const c_void;
        acc.reset().unwrap();
        let before = read_master();
        let via_hooks = shift % 2 == 0;
        let result = if via_hooks {
            acc.begin_microbatch(1).unwrap();
            // SAFETY: the backing memory holds the tensor's numel f32 at `grad` (the margins).
            let added = unsafe { acc.add_tensor_raw(scaler, 1, grad, numel) };
            acc.end_microbatch().unwrap();
            added
        } else {
            let grads = [others[0] as *const c_void, grad, others[1] as *const c_void];
            // SAFETY: as above; `others` hold their tensors' values.
            unsafe { acc.add_raw(scaler, &grads, 1) }
        };
        let what = format!(
            "tensor 1's gradient {shift} elements from its master ({})",
            if via_hooks { "add_tensor" } else { "add" }
        );
        if overlaps {
            let e = result.expect_err(&what);
            assert_eq!(e.kind, gradacc::ErrorKind::InvalidArgument, "{what}: {e:?}");
            assert!(
                e.message.contains("overlaps the accumulator's master"),
                "{what}: {}",
                e.message
            );
            let after = read_master();
            assert!(
                after.iter().zip(&before).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: a refused add changed the master"
            );
            continue;
        }
        result.unwrap_or_else(|e| panic!("{what}: {e:?}"));
        let got = read_master();
        let want = read_backing(start, numel);
        for (k, (g, w)) in got[own..own + numel].iter().zip(&want).enumerate() {
            assert_eq!(*g, w / scale, "{what}: element {k}");
        }
    }
    // An f16 gradient never matches the f32 master element for element: any overlap is refused.
    for byte in [0usize, 2, 4 * own, 4 * own + 2, 4 * (len - 1)] {
        let grad = (base + 4 * OVERLAP_MARGIN + byte) as *const c_void;
        acc.reset().unwrap();
        acc.begin_microbatch(1).unwrap();
        // SAFETY: the backing memory holds 50 f16 from there.
        let e = unsafe { acc.add_tensor_raw(scaler, 2, grad, 50) }
            .expect_err("an f16 gradient inside the master");
        acc.end_microbatch().unwrap();
        assert_eq!(e.kind, gradacc::ErrorKind::InvalidArgument, "f16 at master byte {byte}: {e:?}");
    }
    tried
}

/// The windows of 4 ranks, saved: small-integer f32 gradients (every sum exact, in any order),
/// 1 to 3 micro-batches of random counts each.
pub fn four_saved_windows(
    rng: &mut Rng,
    tensors: &[gradacc::TensorDesc],
    config: gradacc::AccumulatorConfig,
) -> Vec<Vec<u8>> {
    use gradacc::{Accumulator, Grad, Scaler, ScalerConfig};
    let scaler = Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
    (0..4)
        .map(|_| {
            let acc = Accumulator::new(config, tensors).unwrap();
            for _ in 0..rng.range(1, 3) {
                let values: Vec<Vec<f32>> = tensors
                    .iter()
                    .map(|d| (0..d.numel).map(|_| rng.range(0, 64) as f32 - 32.0).collect())
                    .collect();
                let grads: Vec<Grad> = values.iter().map(|v| Grad::F32(v)).collect();
                acc.add(&scaler, &grads, rng.range(1, 9)).unwrap();
            }
            acc.save_window().unwrap()
        })
        .collect()
}

/// FNV-1a, the checksum of saved state and of the layout's fingerprint.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// Element offsets of `tensors` packed back to back, as 0.2 laid them out, plus the total.
pub fn packed_offsets(tensors: &[gradacc::TensorDesc]) -> Vec<usize> {
    let mut offsets = vec![0];
    for t in tensors {
        offsets.push(offsets.last().unwrap() + t.numel);
    }
    offsets
}

/// The fingerprint 0.2 gave the packed layout of `tensors` cut in buckets of `bucket_numel`:
/// written here from the format's definition, independently of the library.
pub fn packed_layout_hash(tensors: &[gradacc::TensorDesc], bucket_numel: usize) -> u64 {
    let offsets = packed_offsets(tensors);
    let mut bytes = Vec::new();
    for (t, &start) in tensors.iter().zip(&offsets) {
        bytes.extend((start as u64).to_le_bytes());
        bytes.extend((t.numel as u64).to_le_bytes());
        bytes.push(t.dtype.code() as u8);
    }
    let (mut start, total) = (0, *offsets.last().unwrap());
    for &end in &offsets[1..] {
        if end - start >= bucket_numel {
            bytes.extend((start as u64).to_le_bytes());
            bytes.extend((end as u64).to_le_bytes());
            start = end;
        }
    }
    if start < total {
        bytes.extend((start as u64).to_le_bytes());
        bytes.extend((total as u64).to_le_bytes());
    }
    fnv1a(&bytes)
}

/// A window in the 0.2 format (version 2, or 3 for `shard` = (shards, rank) of a sharded
/// accumulation): the packed layout's fingerprint, the counts, the written flags and `masters`,
/// the held elements of the packed layout; then the checksum.
pub fn window_saved_by_0_2(
    tensors: &[gradacc::TensorDesc],
    bucket_numel: usize,
    shard: Option<(usize, usize)>,
    (count, microbatches, found_inf): (u64, u64, bool),
    written: &[bool],
    masters: &[f32],
) -> Vec<u8> {
    let mut b = b"GAWN".to_vec();
    b.extend(if shard.is_some() { 3u32 } else { 2u32 }.to_le_bytes());
    b.extend(packed_layout_hash(tensors, bucket_numel).to_le_bytes());
    if let Some((shards, rank)) = shard {
        b.extend((shards as u64).to_le_bytes());
        b.extend((rank as u64).to_le_bytes());
    }
    b.extend(count.to_le_bytes());
    b.extend(microbatches.to_le_bytes());
    b.push(found_inf as u8);
    b.extend(written.iter().map(|&w| w as u8));
    b.extend((masters.len() as u64).to_le_bytes());
    masters.iter().for_each(|m| b.extend(m.to_bits().to_le_bytes()));
    let sum = fnv1a(&b);
    b.extend(sum.to_le_bytes());
    b
}

/// A window saved now, of a whole (unsharded) accumulator, rewritten as 0.2 would have saved it:
/// version 2, without the alignment and the rank-window count, the masters packed.
pub fn as_saved_by_0_2(acc: &gradacc::Accumulator, bytes: &[u8]) -> Vec<u8> {
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    let n = acc.tensors().len();
    // magic and version, fingerprint, alignment, count, micro-batches, rank-windows.
    let (count, microbatches, found_inf) = (u64_at(24), u64_at(32), bytes[48] != 0);
    let written: Vec<bool> = bytes[49..49 + n].iter().map(|&w| w != 0).collect();
    let at = 49 + n + 8;
    let aligned: Vec<f32> = bytes[at..bytes.len() - 8]
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(aligned.len(), acc.len());
    let packed: Vec<f32> = (0..n)
        .flat_map(|i| {
            let o = acc.offset(i).unwrap();
            aligned[o..o + acc.tensors()[i].numel].to_vec()
        })
        .collect();
    let bucket = acc.config().bucket_numel;
    window_saved_by_0_2(
        acc.tensors(),
        bucket,
        None,
        (count, microbatches, found_inf),
        &written,
        &packed,
    )
}

/// Element offsets of `tensors` in the flat master, each at a multiple of `MASTER_ALIGN` bytes,
/// plus the (aligned) total: written from the layout's definition, independently of the library.
pub fn aligned_offsets(tensors: &[gradacc::TensorDesc]) -> Vec<usize> {
    let align = gradacc::accumulator::MASTER_ALIGN / 4;
    let mut offsets = vec![0];
    for t in tensors {
        offsets.push((offsets.last().unwrap() + t.numel).next_multiple_of(align));
    }
    offsets
}

/// The flat master of `acc` holding `masters` (one per tensor), zeros in the padding.
pub fn flat_master(acc: &gradacc::Accumulator, masters: &[Vec<f32>]) -> Vec<f32> {
    let mut flat = vec![0.0; acc.len()];
    for (i, m) in masters.iter().enumerate() {
        let o = acc.offset(i).unwrap();
        flat[o..o + m.len()].copy_from_slice(m);
    }
    flat
}

/// The tensors' elements of `flat`, a flat master of `acc`'s layout, packed back to back; every
/// element of the padding must be zero.
pub fn packed_of(acc: &gradacc::Accumulator, flat: &[f32]) -> Vec<f32> {
    assert_eq!(flat.len(), acc.len(), "the flat master's length");
    let mut packed = Vec::with_capacity(flat.len());
    let mut end = 0;
    for (i, t) in acc.tensors().iter().enumerate() {
        let o = acc.offset(i).unwrap();
        assert!(flat[end..o].iter().all(|v| v.to_bits() == 0), "padding before tensor {i}");
        packed.extend_from_slice(&flat[o..o + t.numel]);
        end = o + t.numel;
    }
    assert!(flat[end..].iter().all(|v| v.to_bits() == 0), "padding after the last tensor");
    packed
}

/// Runs test `name` of this test binary again in a child process with `env` set, and returns its
/// output (stdout, then stderr) once it passed alone; otherwise fails the calling test with that
/// output, saying it was `what`.
pub fn rerun(name: &str, env: &[(&str, &str)], what: &str) -> String {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "{what} failed:\n{text}");
    text
}
