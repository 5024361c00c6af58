//! Fuzz target for the C API: the input bytes are decoded into a sequence of C API calls with
//! arbitrary arguments (NULL, destroyed, random and wrong-type handles; wrong counts, indices,
//! sizes and struct sizes; huge sizes; misaligned buffers; calls out of order; NaN and infinite
//! gradients; corrupted saved state). After every call it checks that a status came back (a
//! crash or an abort is a finding by itself), that an error left a non-empty message naming the
//! function and was never GRADACC_STATUS_INTERNAL, that the call succeeded exactly when a model
//! of the objects says it must, and it keeps a shadow of every object: the master gradient twice,
//! once with the library's documented f32 arithmetic (compared bit for bit at every successful
//! sync) and once in f64 (compared within a rounding bound), the window's counts and overflow
//! flag, and the scaler's scale, trackers and statistics. Communicators are aborted and given
//! timeouts (any value: only single-rank groups ever sync, so no collective can wait), and saved
//! windows, whole or damaged, are merged into windows in progress.

#![no_main]

use std::ffi::{c_void, CStr};
use std::ptr::{null, null_mut};

use gradacc_capi::*;
use libfuzzer_sys::fuzz_target;

/// Input bytes, read front to back; reads past the end give 0, and the run stops there.
struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Input<'_> {
    fn done(&self) -> bool {
        self.pos >= self.data.len()
    }
    fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
    fn below(&mut self, n: usize) -> usize {
        self.u8() as usize % n
    }
    fn u64(&mut self) -> u64 {
        (0..8).fold(0u64, |v, _| (v << 8) | self.u8() as u64)
    }
}

/// A length of `size`-byte values whose byte size exceeds isize::MAX (what a negative or wrapped
/// length gives): the library must refuse it before forming a slice.
fn absurd_len(input: &mut Input, size: usize) -> usize {
    [isize::MAX as usize / size + 1, usize::MAX / size, 1 << 63, usize::MAX][input.below(4)]
}

// ---- the model ---------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
struct ScalerCfg {
    init_scale: f32,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u32,
    hysteresis: u32,
    consecutive_hysteresis: bool,
    min_scale: f32,
    max_scale: f32,
    dynamic: bool,
}

impl ScalerCfg {
    /// The header's contract for each field.
    fn valid(&self) -> bool {
        let c = self;
        c.init_scale.is_finite()
            && c.init_scale > 0.0
            && c.growth_factor.is_finite()
            && c.growth_factor > 1.0
            && c.backoff_factor > 0.0
            && c.backoff_factor < 1.0
            && c.growth_interval >= 1
            && c.hysteresis >= 1
            && c.min_scale.is_finite()
            && c.min_scale > 0.0
            && !c.max_scale.is_nan()
            && c.max_scale >= c.init_scale
            && c.min_scale <= c.init_scale
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct ScalerModel {
    cfg: ScalerCfg,
    scale: f32,
    growth_tracker: u32,
    hysteresis_tracker: u32,
    stats: [u64; 4], // steps, skipped, growths, backoffs
}

impl ScalerModel {
    fn new(cfg: ScalerCfg) -> Self {
        ScalerModel {
            cfg,
            scale: cfg.init_scale,
            growth_tracker: 0,
            hysteresis_tracker: cfg.hysteresis,
            stats: [0; 4],
        }
    }

    /// PyTorch GradScaler with Megatron-Core's hysteresis and DeepSpeed's consecutive option, as
    /// the header describes them. None: the update must fail with SCALE_AT_MINIMUM.
    fn update(&self, found_inf: bool) -> Option<ScalerModel> {
        let c = self.cfg;
        let mut n = *self;
        n.stats[0] += 1;
        if found_inf {
            n.stats[1] += 1;
        }
        if !c.dynamic {
            return Some(n);
        }
        if found_inf {
            n.growth_tracker = 0;
            n.hysteresis_tracker = self.hysteresis_tracker.saturating_sub(1);
            if n.hysteresis_tracker == 0 {
                if self.scale <= c.min_scale {
                    return None;
                }
                n.scale = (self.scale * c.backoff_factor).max(c.min_scale);
                n.stats[3] += 1;
            }
        } else {
            if c.consecutive_hysteresis {
                n.hysteresis_tracker = c.hysteresis;
            }
            n.growth_tracker += 1;
            if n.growth_tracker == c.growth_interval {
                n.growth_tracker = 0;
                n.hysteresis_tracker = c.hysteresis;
                let grown = (self.scale * c.growth_factor).min(c.max_scale);
                if grown.is_finite() && grown > self.scale {
                    n.scale = grown;
                    n.stats[2] += 1;
                }
            }
        }
        Some(n)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    Empty,
    Open,
    InMicrobatch(u64),
    Synced(bool),
}

#[derive(Clone, Debug)]
struct Window {
    phase: Phase,
    count: u64,
    microbatches: u64,
    /// The rank-windows it sums once a load or merge set it; 0 for this rank's own alone.
    ranks: u64,
    found_inf: bool,
    written: Vec<bool>,
    /// The library's arithmetic: a rounded f32 multiply, then a rounded f32 add.
    sim: Vec<f32>,
    /// The exact sum in f64, and the sum of magnitudes (for the rounding bound) and additions.
    exact: Vec<f64>,
    magnitude: Vec<f64>,
    adds: Vec<u32>,
    /// Sum of |gradient| × weight: bounds the error of a subnormal unscale factor.
    raw: Vec<f64>,
}

struct AccModel {
    handle: *mut gradacc_accumulator_t,
    numels: Vec<usize>,
    dtypes: Vec<i32>,
    offsets: Vec<usize>,
    mean: bool,
    normalize: i32,
    max_grad_norm: f32,
    bucket_numel: u64,
    w: Window,
    /// Successful syncs: the synced window's identity, for the optimizer's one step per window.
    syncs: u64,
    /// The caller's master buffer, for accumulators created with one.
    _buffer: Option<Vec<f32>>,
}

impl AccModel {
    fn total(&self) -> usize {
        *self.offsets.last().unwrap()
    }
    /// Tensor `t`'s elements in the flat master (its padding follows).
    fn tensor(&self, t: usize) -> std::ops::Range<usize> {
        self.offsets[t]..self.offsets[t] + self.numels[t]
    }
    fn fresh_window(&self) -> Window {
        let t = self.total();
        Window {
            phase: Phase::Empty,
            count: 0,
            microbatches: 0,
            ranks: 0,
            found_inf: false,
            written: vec![false; self.numels.len()],
            sim: vec![0.0; t],
            exact: vec![0.0; t],
            magnitude: vec![0.0; t],
            adds: vec![0; t],
            raw: vec![0.0; t],
        }
    }
    fn weights_by_count(&self) -> bool {
        self.mean && self.normalize == GRADACC_NORMALIZE_BY_COUNT
    }
    fn count_ok(&self, count: u64) -> bool {
        if count == 0 && self.mean {
            return false;
        }
        let base = if matches!(self.w.phase, Phase::Synced(_)) { 0 } else { self.w.count };
        base.checked_add(count).is_some_and(|t| t <= 1 << 47)
    }
    fn restart_if_synced(&mut self) {
        if matches!(self.w.phase, Phase::Synced(_)) {
            self.w = self.fresh_window();
        }
    }
    /// One tensor's contribution, exactly as the fused pass does it; `decoded` holds the gradient's
    /// values as f32 (already converted from their dtype).
    fn contribute(&mut self, index: usize, decoded: &[f32], scale: f32, count: u64) {
        let weight = if self.weights_by_count() { count as f64 } else { 1.0 };
        let factor = (weight / scale as f64) as f32;
        let assign = !self.w.written[index];
        let base = self.offsets[index];
        for (k, &g) in decoded.iter().enumerate() {
            let i = base + k;
            let v = g * factor;
            let m = if assign { v } else { self.w.sim[i] + v };
            self.w.sim[i] = m;
            if !m.is_finite() {
                self.w.found_inf = true;
            }
            let term = g as f64 * weight / scale as f64;
            let raw = (g as f64 * weight).abs();
            if assign {
                self.w.exact[i] = term;
                self.w.magnitude[i] = term.abs();
                self.w.adds[i] = 1;
                self.w.raw[i] = raw;
            } else {
                self.w.exact[i] += term;
                self.w.magnitude[i] += term.abs();
                self.w.adds[i] += 1;
                self.w.raw[i] += raw;
            }
        }
        self.w.written[index] = true;
    }
}

/// A live communicator handle.
struct CommModel {
    handle: *mut gradacc_comm_t,
    rank: usize,
    size: usize,
    /// Index into `World::aborted`: an abort of any rank fails the whole in-process group.
    group: usize,
    /// Seconds; 0 waits forever.
    timeout: f64,
}

struct World {
    scalers: Vec<(*mut gradacc_scaler_t, ScalerModel)>,
    accs: Vec<AccModel>,
    comms: Vec<CommModel>,
    opts: Vec<optimizer::OptModel>,
    /// Whether each group ever created was aborted.
    aborted: Vec<bool>,
    /// Handles that were destroyed: never valid again.
    dead: Vec<usize>,
    windows: Vec<Vec<u8>>,
    scaler_states: Vec<Vec<u8>>,
    opt_states: Vec<Vec<u8>>,
    calls: u64,
    syncs_checked: u64,
    /// Optimizer steps taken (not skipped) and checked against the model.
    opt_steps: u64,
    /// Of those, steps whose adopted masters were compared with the model's.
    adopted_steps: u64,
}

const MAX_OBJECTS: usize = 4;

/// Handle choices shared by every handle argument.
enum Pick {
    Live(usize),
    Null,
    Dead(usize),
    Random(usize),
    Other(usize),
}

fn last_error() -> String {
    unsafe { CStr::from_ptr(gradacc_last_error()) }.to_string_lossy().into_owned()
}

impl World {
    /// Checks one call's status: OK exactly when the model expects it, and on failure a real
    /// error code (never INTERNAL, which is a caught panic) with a message naming the function.
    fn check(&mut self, function: &str, status: gradacc_status_t, expect_ok: bool) -> bool {
        self.calls += 1;
        if status != GRADACC_STATUS_OK {
            let msg = last_error();
            assert!(
                (1..=15).contains(&(status as i32)) && status != GRADACC_STATUS_INTERNAL,
                "{function}: status {status:?}: {msg}"
            );
            assert!(
                msg.starts_with(function),
                "{function} failed with status {status:?} but the last error is {msg:?}"
            );
            let text =
                unsafe { CStr::from_ptr(gradacc_status_string(status as i32)) }.to_string_lossy();
            assert!(text.starts_with("GRADACC_STATUS_"), "{text}");
        }
        assert_eq!(
            status == GRADACC_STATUS_OK,
            expect_ok,
            "{function}: returned {status:?} ({}), the model expected {}",
            last_error(),
            if expect_ok { "success" } else { "an error" }
        );
        status == GRADACC_STATUS_OK
    }

    fn pick(&mut self, input: &mut Input, live: usize) -> Pick {
        match input.u8() % 16 {
            0 => Pick::Null,
            1 => Pick::Dead(input.u8() as usize),
            2 => Pick::Random(input.u64() as usize),
            3 => Pick::Other(input.u8() as usize),
            _ if live == 0 => Pick::Null,
            b => Pick::Live((b as usize + input.u8() as usize) % live),
        }
    }

    fn other_handle(&self, k: usize) -> usize {
        let mut all: Vec<usize> = self.scalers.iter().map(|s| s.0 as usize).collect();
        all.extend(self.accs.iter().map(|a| a.handle as usize));
        all.extend(self.comms.iter().map(|c| c.handle as usize));
        all.extend(self.opts.iter().map(|o| o.handle as usize));
        if all.is_empty() {
            0x6ac0_0000 + 16 * k
        } else {
            all[k % all.len()]
        }
    }

    fn dead_handle(&self, k: usize) -> usize {
        if self.dead.is_empty() {
            0x6ac0_0010
        } else {
            self.dead[k % self.dead.len()]
        }
    }

    /// A scaler argument: (pointer, index of the live scaler it is, if any).
    fn scaler_arg(&mut self, input: &mut Input) -> (*mut gradacc_scaler_t, Option<usize>) {
        match self.pick(input, self.scalers.len()) {
            Pick::Live(i) => (self.scalers[i].0, Some(i)),
            Pick::Null => (null_mut(), None),
            p => {
                let h = self.stray(p);
                (h as *mut _, self.scalers.iter().position(|s| s.0 as usize == h))
            }
        }
    }

    fn acc_arg(&mut self, input: &mut Input) -> (*mut gradacc_accumulator_t, Option<usize>) {
        match self.pick(input, self.accs.len()) {
            Pick::Live(i) => (self.accs[i].handle, Some(i)),
            Pick::Null => (null_mut(), None),
            p => {
                let h = self.stray(p);
                (h as *mut _, self.accs.iter().position(|a| a.handle as usize == h))
            }
        }
    }

    fn comm_arg(&mut self, input: &mut Input) -> (*mut gradacc_comm_t, Option<usize>) {
        match self.pick(input, self.comms.len()) {
            Pick::Live(i) => (self.comms[i].handle, Some(i)),
            Pick::Null => (null_mut(), None),
            p => {
                let h = self.stray(p);
                (h as *mut _, self.comms.iter().position(|c| c.handle as usize == h))
            }
        }
    }

    fn stray(&self, p: Pick) -> usize {
        match p {
            Pick::Dead(k) => self.dead_handle(k),
            Pick::Random(v) => v,
            Pick::Other(k) => self.other_handle(k),
            _ => 0,
        }
    }

    fn scale_of(&self, s: Option<usize>) -> f32 {
        s.map_or(f32::NAN, |i| self.scalers[i].1.scale)
    }
}

// ---- gradients
// -----------------------------------------------------------------------------------

/// A gradient buffer with room for a misaligning offset, and its values decoded to f32.
struct GradBuf {
    storage: Vec<u32>,
    offset: usize,
    decoded: Vec<f32>,
}

impl GradBuf {
    fn ptr(&self) -> *const c_void {
        unsafe { (self.storage.as_ptr() as *const u8).add(self.offset) as *const c_void }
    }
}

/// Unscaled values a backward pass might produce, and the odd ones it sometimes does.
fn value(input: &mut Input) -> f32 {
    let b = input.u8();
    match b % 32 {
        0 => f32::NAN,
        1 => f32::INFINITY,
        2 => f32::NEG_INFINITY,
        3 => 65504.0,
        4 => 1e-7,
        5 => -3.0e4,
        6 => 0.0,
        7 => -0.0,
        _ => ((b as i32 - 128) as f32) * 0.125,
    }
}

/// `numel` elements of `dtype` holding value × scale rounded into the dtype (as a scaled backward
/// produces them), at a byte offset that misaligns the buffer when `misalign` is set.
fn make_grad(input: &mut Input, dtype: i32, numel: usize, scale: f32, misalign: bool) -> GradBuf {
    let size = if dtype == GRADACC_DTYPE_F32 { 4 } else { 2 };
    let mut storage = vec![0u32; numel + 2];
    let offset = if misalign { size / 2 } else { 0 };
    let mut decoded = Vec::with_capacity(numel);
    let scale = if scale.is_finite() { scale } else { 1.0 };
    for k in 0..numel {
        let v = value(input) * scale;
        let (bits, back): (u32, f32) = match dtype {
            GRADACC_DTYPE_F16 => {
                let h = half::f16::from_f32(v);
                (h.to_bits() as u32, h.to_f32())
            }
            GRADACC_DTYPE_BF16 => {
                let h = half::bf16::from_f32(v);
                (h.to_bits() as u32, h.to_f32())
            }
            _ => (v.to_bits(), v),
        };
        decoded.push(back);
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(storage.as_mut_ptr() as *mut u8, storage.len() * 4)
        };
        let at = offset + k * size;
        bytes[at..at + size].copy_from_slice(&bits.to_le_bytes()[..size]);
    }
    GradBuf { storage, offset, decoded }
}

// ---- saved state
// ---------------------------------------------------------------------------------

fn fnv(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

fn rechecksum(bytes: &mut [u8]) {
    if bytes.len() >= 16 {
        let n = bytes.len() - 8;
        let sum = fnv(&bytes[..n]);
        bytes[n..].copy_from_slice(&sum.to_le_bytes());
    }
}

/// How the bytes to load are damaged, and whether they can still be valid afterwards.
fn mutate(input: &mut Input, bytes: &mut Vec<u8>) -> Option<usize> {
    match input.u8() % 8 {
        0..=2 => None,
        3 => {
            let i = input.u64() as usize % bytes.len().max(1);
            if !bytes.is_empty() {
                bytes[i] ^= 1 << (input.u8() % 8);
            }
            Some(usize::MAX) // checksum broken: must fail
        }
        4 => {
            let cut = input.u64() as usize % bytes.len().max(1);
            bytes.truncate(cut);
            Some(usize::MAX)
        }
        5 => {
            if bytes.len() >= 8 {
                bytes[4] = bytes[4].wrapping_add(1 + input.u8() % 200); // another format version
            }
            rechecksum(bytes);
            Some(usize::MAX)
        }
        _ => {
            // A field changed and the checksum recomputed: valid or not depending on the field.
            if bytes.len() < 17 {
                return Some(usize::MAX);
            }
            let i = 8 + input.u64() as usize % (bytes.len() - 16);
            bytes[i] = input.u8();
            rechecksum(bytes);
            Some(i)
        }
    }
}

struct Reader<'a>(&'a [u8], usize);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let s = self.0.get(self.1..self.1 + n)?;
        self.1 += n;
        Some(s)
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn f32(&mut self) -> Option<f32> {
        Some(f32::from_bits(u32::from_le_bytes(self.take(4)?.try_into().unwrap())))
    }
    fn bool(&mut self) -> Option<bool> {
        match self.take(1)?[0] {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }
}

/// The scaler state the bytes hold, if the header's contract accepts them.
fn decode_scaler(bytes: &[u8]) -> Option<ScalerModel> {
    if bytes.len() < 16 || &bytes[..4] != b"GASC" || bytes[4..8] != 1u32.to_le_bytes() {
        return None;
    }
    let (body, tail) = bytes.split_at(bytes.len() - 8);
    if fnv(body).to_le_bytes() != tail {
        return None;
    }
    let mut r = Reader(body, 8);
    let small = |v: u64| u32::try_from(v).ok();
    let cfg = ScalerCfg {
        init_scale: r.f32()?,
        growth_factor: r.f32()?,
        backoff_factor: r.f32()?,
        growth_interval: small(r.u64()?)?,
        hysteresis: small(r.u64()?)?,
        consecutive_hysteresis: r.bool()?,
        min_scale: r.f32()?,
        max_scale: r.f32()?,
        dynamic: r.bool()?,
    };
    let scale = r.f32()?;
    let growth_tracker = small(r.u64()?)?;
    let hysteresis_tracker = small(r.u64()?)?;
    let stats = [r.u64()?, r.u64()?, r.u64()?, r.u64()?];
    if r.1 != body.len() || !cfg.valid() {
        return None;
    }
    if !(scale.is_finite() && scale >= cfg.min_scale && scale <= cfg.max_scale)
        || growth_tracker >= cfg.growth_interval
        || hysteresis_tracker > cfg.hysteresis
    {
        return None;
    }
    Some(ScalerModel { cfg, scale, growth_tracker, hysteresis_tracker, stats })
}

/// Where a tensor after `end` starts: GRADACC_MASTER_ALIGN bytes.
const MASTER_ALIGN: usize = GRADACC_MASTER_ALIGN as usize;
fn align(end: usize) -> usize {
    end.div_ceil(MASTER_ALIGN / 4).saturating_mul(MASTER_ALIGN / 4)
}

/// The accumulator's layout fingerprint, as the saved window holds it: the state checksum (FNV-1a)
/// of each tensor's offset and length (little-endian u64) and dtype byte, then its buckets' element
/// ranges as little-endian u64 pairs.
fn layout_hash(a: &AccModel) -> u64 {
    let mut buckets = vec![];
    let mut start = 0usize;
    for &end in &a.offsets[1..] {
        if (end - start) as u64 >= a.bucket_numel {
            buckets.push((start, end));
            start = end;
        }
    }
    if start < a.total() {
        buckets.push((start, a.total()));
    }
    let mut bytes = vec![];
    for i in 0..a.numels.len() {
        bytes.extend((a.offsets[i] as u64).to_le_bytes());
        bytes.extend((a.numels[i] as u64).to_le_bytes());
        bytes.push(a.dtypes[i] as u8);
    }
    bytes
        .extend(buckets.iter().flat_map(|&(s, e)| [s as u64, e as u64]).flat_map(u64::to_le_bytes));
    fnv(&bytes)
}

/// The window the bytes hold for an accumulator of `a`'s shape; `layout_same` says whether the
/// saved layout field matches this accumulator's.
fn decode_window(bytes: &[u8], a: &AccModel, layout_same: bool) -> Option<Window> {
    // Whole windows: format 2 (0.2, one rank's window), 4 (with its rank-window count), both
    // packed, which load only into a layout without padding, and 6 (aligned tensors).
    let version = bytes.get(4..8).map(|v| u32::from_le_bytes(v.try_into().unwrap()));
    let padded = (0..a.numels.len()).any(|t| a.tensor(t).end != a.offsets[t + 1]);
    if bytes.len() < 16
        || &bytes[..4] != b"GAWN"
        || !matches!(version, Some(6)) && !(matches!(version, Some(2 | 4)) && !padded)
    {
        return None;
    }
    let (body, tail) = bytes.split_at(bytes.len() - 8);
    if fnv(body).to_le_bytes() != tail {
        return None;
    }
    let mut r = Reader(body, 8);
    r.u64()?;
    if version == Some(6) && r.u64()? != MASTER_ALIGN as u64 {
        return None;
    }
    if !layout_same {
        return None;
    }
    let (count, microbatches) = (r.u64()?, r.u64()?);
    let ranks = if version != Some(2) { r.u64()? } else { 1 };
    let found_inf = r.bool()?;
    let written: Vec<bool> = (0..a.numels.len()).map(|_| r.bool()).collect::<Option<_>>()?;
    if r.u64()? != a.total() as u64 {
        return None;
    }
    let sim: Vec<f32> = (0..a.total()).map(|_| r.f32()).collect::<Option<_>>()?;
    if r.1 != body.len() {
        return None;
    }
    // The padding holds +0, as the library saves it: anything else is refused.
    let padding = |t: usize| a.tensor(t).end..a.offsets[t + 1];
    if (0..a.numels.len()).any(|t| sim[padding(t)].iter().any(|v| v.to_bits() != 0)) {
        return None;
    }
    // Counts no window can have: refused as corrupt.
    if count > 1 << 47 || (microbatches == 0 && count != 0) || !(1..=1 << 32).contains(&ranks) {
        return None;
    }
    let mut w = a.fresh_window();
    w.ranks = ranks;
    w.phase = if microbatches == 0 { Phase::Empty } else { Phase::Open };
    w.count = count;
    w.microbatches = microbatches;
    // Loading re-derives the overflow from the masters: a non-finite value is one.
    w.found_inf = found_inf || sim.iter().any(|v| !v.is_finite());
    for (t, &was) in written.iter().enumerate() {
        w.written[t] = was;
        if was {
            for i in a.tensor(t) {
                w.exact[i] = sim[i] as f64;
                w.magnitude[i] = (sim[i] as f64).abs();
                w.adds[i] = 1;
            }
        }
    }
    w.sim = sim;
    Some(w)
}

// ---- the operations
// ------------------------------------------------------------------------------

fn pointee_size<F>(_: *const F) -> usize {
    std::mem::size_of::<F>()
}

/// The end offset of each listed field of a struct, in order.
macro_rules! field_ends {
    ($t:ty: $($field:ident),+) => {{
        let u = std::mem::MaybeUninit::<$t>::uninit();
        let p = u.as_ptr();
        [$(std::mem::offset_of!($t, $field) + pointee_size(unsafe { std::ptr::addr_of!((*p).$field) })),+]
    }};
}

/// What the library reads from a config whose struct_size is `c.struct_size`: the fields that end
/// within that size (an older header's struct) over the defaults; None for a refused size (0,
/// larger than the struct, or not the end of a field, padded to the struct's alignment or not).
fn config_as_read<T: Copy>(c: &T, defaults: &T, field_ends: &[usize]) -> Option<T> {
    let size = unsafe { *(c as *const T as *const usize) };
    let align = std::mem::align_of::<T>();
    if size > std::mem::size_of::<T>()
        || !field_ends.iter().any(|&e| size == e || size == e.next_multiple_of(align))
    {
        return None;
    }
    // Only the fields: the bytes past the last one up to `size` are the older struct's padding.
    let fields = field_ends.iter().copied().filter(|&e| e <= size).max().unwrap_or(0);
    let mut out = *defaults;
    unsafe {
        std::ptr::copy_nonoverlapping(
            c as *const T as *const u8,
            &mut out as *mut T as *mut u8,
            fields,
        )
    };
    Some(out)
}

const POW2_SCALES: [f32; 6] = [1.0, 2.0, 256.0, 1024.0, 65536.0, 16777216.0];

fn scaler_create(world: &mut World, input: &mut Input) {
    let mut c = std::mem::MaybeUninit::<gradacc_scaler_config_t>::uninit();
    assert_eq!(unsafe { gradacc_scaler_config_default(c.as_mut_ptr()) }, GRADACC_STATUS_OK);
    let defaults = unsafe { c.assume_init() };
    let mut c = defaults;
    let variant = input.u8();
    let mut pass_null = false;
    match variant % 8 {
        0 => pass_null = true,
        1 => {}
        2 => c.struct_size = input.u8() as usize,
        _ => {
            c.init_scale = POW2_SCALES[input.below(POW2_SCALES.len())];
            c.growth_interval = 1 + input.below(4) as u32;
            c.hysteresis = 1 + input.below(3) as u32;
            c.consecutive_hysteresis = input.u8() & 1 == 1;
            c.min_scale = [1.0, 0.5, 64.0, 2.0][input.below(4)];
            c.max_scale = [f32::INFINITY, 1e9, 65536.0, 1024.0][input.below(4)];
            c.dynamic = input.u8() % 8 != 0;
            if variant % 8 == 7 {
                // one field pushed out of its domain (or not, when the pick happens to be valid)
                match input.below(7) {
                    0 => c.init_scale = [0.0, -1.0, f32::NAN, f32::INFINITY][input.below(4)],
                    1 => c.growth_factor = [1.0, 0.5, f32::INFINITY, f32::NAN][input.below(4)],
                    2 => c.backoff_factor = [0.0, 1.0, 2.0, f32::NAN][input.below(4)],
                    3 => c.growth_interval = 0,
                    4 => c.hysteresis = 0,
                    5 => c.min_scale = [0.0, f32::NAN, f32::INFINITY, 1e30][input.below(4)],
                    _ => c.max_scale = [f32::NAN, 0.25, -1.0, 1e30][input.below(4)],
                }
            }
        }
    }
    let device = gradacc_device_t { kind: GRADACC_DEVICE_CPU, ordinal: 0, stream: null_mut() };
    let mut bad_device = device;
    let (device_ptr, device_ok): (*const gradacc_device_t, bool) = match input.u8() % 8 {
        0 => {
            bad_device.kind = GRADACC_DEVICE_CUDA;
            (&bad_device, false)
        }
        1 => {
            bad_device.ordinal = 1;
            (&bad_device, false)
        }
        2 => {
            bad_device.kind = 77;
            (&bad_device, false)
        }
        3 => (&device, true),
        _ => (null(), true),
    };
    let null_out = input.u8() % 16 == 0;
    let mut out: *mut gradacc_scaler_t = 0x5 as *mut _; // must stay as it is on failure
    let ends = field_ends!(gradacc_scaler_config_t: struct_size, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
        consecutive_hysteresis, min_scale, max_scale, dynamic);
    let read = if pass_null { Some(c) } else { config_as_read(&c, &defaults, &ends) };
    let r = read.unwrap_or(c);
    let cfg = ScalerCfg {
        init_scale: r.init_scale,
        growth_factor: r.growth_factor,
        backoff_factor: r.backoff_factor,
        growth_interval: r.growth_interval,
        hysteresis: r.hysteresis,
        consecutive_hysteresis: r.consecutive_hysteresis,
        min_scale: r.min_scale,
        max_scale: r.max_scale,
        dynamic: r.dynamic,
    };
    let cfg_ok = read.is_some() && cfg.valid();
    let want = cfg_ok && device_ok && !null_out && world.scalers.len() < MAX_OBJECTS;
    if world.scalers.len() >= MAX_OBJECTS && cfg_ok && device_ok && !null_out {
        return; // keep the population small
    }
    let status = unsafe {
        gradacc_scaler_create(
            if pass_null { null() } else { &c },
            device_ptr,
            if null_out { null_mut() } else { &mut out },
        )
    };
    if world.check("gradacc_scaler_create", status, want) {
        // With a NULL config, `c` is still gradacc_scaler_config_default's output: the defaults.
        world.scalers.push((out, ScalerModel::new(cfg)));
    } else {
        assert_eq!(out as usize, 0x5, "gradacc_scaler_create wrote its output on failure");
    }
}

fn acc_create(world: &mut World, input: &mut Input) {
    let mut c = std::mem::MaybeUninit::<gradacc_accumulator_config_t>::uninit();
    assert_eq!(unsafe { gradacc_accumulator_config_default(c.as_mut_ptr()) }, GRADACC_STATUS_OK);
    let defaults = unsafe { c.assume_init() };
    let mut c = defaults;
    let pass_null_config = input.u8() % 4 == 0;
    let mut cfg_ok = true;
    if !pass_null_config {
        c.loss_reduction = input.below(2) as i32;
        c.normalize = input.below(4) as i32;
        c.max_grad_norm = [0.0, 0.0, 1.0, 0.01, 100.0][input.below(5)];
        // Any bucket size is valid, up to one no buffer could hold: buckets hold whole tensors.
        c.bucket_numel = [4 << 20, 1, 7, 64, u64::MAX][input.below(5)];
        c.threads = [1, 1, 2, 3][input.below(4)];
        match input.u8() % 16 {
            0 => c.struct_size = input.u8() as usize,
            1 => c.loss_reduction = 2 + input.u8() as i32,
            2 => c.normalize = -1 - input.u8() as i32,
            3 => c.max_grad_norm = [-1.0, f32::NAN, f32::INFINITY][input.below(3)],
            4 => c.bucket_numel = 0,
            5 => c.threads = [0, 1025, u32::MAX][input.below(3)],
            // One shard of one, and a bf16 wire, behave as the defaults for a rank alone (the
            // model's accumulators sync alone); the rest is refused. Sharded accumulation
            // (GRADACC_SHARDING_ACCUMULATE) saves windows no other accumulator loads: the model
            // leaves it out.
            6 => c.sharding = [GRADACC_SHARDING_REDUCE_SCATTER, 3, -1][input.below(3)],
            7 => {
                (c.shard_count, c.shard_rank) =
                    [(0, 0), (2, 2), (1, 1), (3, 0), (u32::MAX, 0), (65537, 1)][input.below(6)]
            }
            8 => c.wire_dtype = [GRADACC_DTYPE_BF16, GRADACC_DTYPE_F16, 7][input.below(3)],
            9 => c.reserved = input.u8() as u32,
            // The model is SKIP_STEP without telemetry: only refused values of the two.
            10 => c.overflow = [2, -1, i32::MAX][input.below(3)],
            11 => c.tensor_stats = [2, u32::MAX][input.below(2)],
            _ => {}
        }
        let ends = field_ends!(gradacc_accumulator_config_t: struct_size, loss_reduction, normalize, max_grad_norm, bucket_numel, threads,
            reserved, sharding, shard_count, shard_rank, wire_dtype, overflow, tensor_stats);
        let read = config_as_read(&c, &defaults, &ends);
        cfg_ok = read.is_some();
        // The model works on what the library read: an older size leaves the later fields at their
        // defaults.
        c = read.unwrap_or(c);
        cfg_ok = cfg_ok
            && (0..=1).contains(&c.loss_reduction)
            && (0..=3).contains(&c.normalize)
            && c.max_grad_norm.is_finite()
            && c.max_grad_norm >= 0.0
            && c.bucket_numel >= 1
            && (1..=1024).contains(&c.threads)
            && match c.sharding {
                GRADACC_SHARDING_NONE => (c.shard_count, c.shard_rank) == (1, 0),
                GRADACC_SHARDING_REDUCE_SCATTER => {
                    c.shard_rank < c.shard_count && c.shard_count <= 1 << 16
                }
                _ => false,
            }
            && [GRADACC_DTYPE_F32, GRADACC_DTYPE_BF16].contains(&c.wire_dtype)
            && c.overflow == GRADACC_OVERFLOW_SKIP_STEP
            && c.tensor_stats == 0;
    }
    let n = 1 + input.below(4);
    let mut descs: Vec<gradacc_tensor_desc_t> = (0..n)
        .map(|_| gradacc_tensor_desc_t {
            numel: 1 + input.below(40) as u64,
            dtype: input.below(3) as i32,
        })
        .collect();
    let mut n_arg = n;
    let mut tensors_ok = true;
    let mut tensors_ptr = descs.as_ptr();
    match input.u8() % 12 {
        0 => {
            n_arg = 0;
            tensors_ok = false;
        }
        1 => {
            tensors_ptr = null();
            tensors_ok = false;
        }
        2 => {
            descs[input.below(n)].numel =
                [0, u64::MAX, 1 << 62, (isize::MAX as u64) / 4 + 1][input.below(4)];
            tensors_ok = false;
        }
        3 => {
            descs[input.below(n)].dtype = [3, -1, i32::MAX][input.below(3)];
            tensors_ok = false;
        }
        5 => {
            // a count whose descriptors exceed the address space: refused before any is read
            n_arg = absurd_len(input, size_of::<gradacc_tensor_desc_t>());
            tensors_ok = false;
        }
        4 if n >= 2 => {
            // each tensor fine alone, the total overflows
            descs[0].numel = (isize::MAX as u64) / 4;
            descs[1].numel = 2;
            tensors_ok = false;
        }
        _ => {}
    }
    let bad_device = gradacc_device_t { kind: GRADACC_DEVICE_CUDA, ordinal: 0, stream: null_mut() };
    let (device, device_ok): (*const gradacc_device_t, bool) =
        if input.u8() % 16 == 0 { (&bad_device, false) } else { (null(), true) };
    // Each tensor starts at a multiple of GRADACC_MASTER_ALIGN bytes, zeros between.
    let total: usize = descs.iter().fold(0usize, |a, d| align(a.saturating_add(d.numel as usize)));
    let with_buffer = input.u8() % 4 == 0;
    let mut buffer: Option<Vec<f32>> = None;
    let mut buffer_ok = true;
    let null_out = input.u8() % 16 == 0;
    if world.accs.len() >= MAX_OBJECTS && cfg_ok && tensors_ok && device_ok && !null_out {
        return;
    }
    let mut out: *mut gradacc_accumulator_t = 0x9 as *mut _;
    let out_ptr = if null_out { null_mut() } else { &mut out as *mut _ };
    let config_ptr = if pass_null_config { null() } else { &c as *const _ };
    let status = if with_buffer {
        let kind = input.u8() % 8;
        let claimed = match kind {
            0 => total.wrapping_add(1),
            1 => total.saturating_sub(1),
            2 => usize::MAX,
            _ => total,
        };
        buffer_ok = claimed == total;
        let mut buf = vec![f32::NAN; if buffer_ok && tensors_ok { total + 1 } else { 1 }];
        let mut ptr = buf.as_mut_ptr();
        if kind == 3 {
            ptr = null_mut();
            buffer_ok = false;
        } else if kind == 4 && buffer_ok {
            ptr = unsafe { (ptr as *mut u8).add(2) as *mut f32 };
            buffer_ok = false;
        }
        buffer = Some(buf);
        unsafe {
            gradacc_accumulator_create_with_buffer(
                config_ptr,
                tensors_ptr,
                n_arg,
                device,
                ptr,
                claimed,
                out_ptr,
            )
        }
    } else {
        unsafe { gradacc_accumulator_create(config_ptr, tensors_ptr, n_arg, device, out_ptr) }
    };
    let want = cfg_ok && tensors_ok && device_ok && buffer_ok && !null_out;
    let function = if with_buffer {
        "gradacc_accumulator_create_with_buffer"
    } else {
        "gradacc_accumulator_create"
    };
    if world.check(function, status, want) {
        let numels: Vec<usize> = descs.iter().map(|d| d.numel as usize).collect();
        let mut offsets = vec![0];
        for &k in &numels {
            offsets.push(align(offsets.last().unwrap() + k));
        }
        // With a NULL config, `c` is still gradacc_accumulator_config_default's output.
        let (mean, normalize, max_grad_norm, bucket_numel) = (
            c.loss_reduction == GRADACC_LOSS_REDUCTION_MEAN,
            c.normalize,
            c.max_grad_norm,
            c.bucket_numel,
        );
        let mut a = AccModel {
            handle: out,
            numels,
            dtypes: descs.iter().map(|d| d.dtype).collect(),
            offsets,
            mean,
            normalize,
            max_grad_norm,
            bucket_numel,
            w: Window {
                phase: Phase::Empty,
                count: 0,
                microbatches: 0,
                ranks: 0,
                found_inf: false,
                written: vec![],
                sim: vec![],
                exact: vec![],
                magnitude: vec![],
                adds: vec![],
                raw: vec![],
            },
            _buffer: buffer,
            syncs: 0,
        };
        a.w = a.fresh_window();
        world.accs.push(a);
    } else {
        assert_eq!(out as usize, 0x9, "{function} wrote its output on failure");
    }
}

fn destroy(world: &mut World, input: &mut Input) {
    match input.below(3) {
        0 => {
            let (h, live) = world.scaler_arg(input);
            let st = unsafe { gradacc_scaler_destroy(h) };
            if world.check("gradacc_scaler_destroy", st, h.is_null() || live.is_some())
                && !h.is_null()
            {
                world.scalers.remove(live.unwrap());
                world.dead.push(h as usize);
            }
        }
        1 => {
            let (h, live) = world.acc_arg(input);
            let st = unsafe { gradacc_accumulator_destroy(h) };
            if world.check("gradacc_accumulator_destroy", st, h.is_null() || live.is_some())
                && !h.is_null()
            {
                world.accs.remove(live.unwrap());
                world.dead.push(h as usize);
                // Its optimizers live on, over an accumulator no handle names any more.
                for o in world.opts.iter_mut().filter(|o| o.acc == h) {
                    o.acc = null_mut();
                }
            }
        }
        _ => {
            let (h, live) = world.comm_arg(input);
            let st = unsafe { gradacc_comm_destroy(h) };
            if world.check("gradacc_comm_destroy", st, h.is_null() || live.is_some())
                && !h.is_null()
            {
                world.comms.remove(live.unwrap());
                world.dead.push(h as usize);
            }
        }
    }
}

fn count_arg(input: &mut Input) -> u64 {
    match input.u8() % 16 {
        0 => 0,
        1 => u64::MAX,
        2 => u64::MAX / 2,
        3 => 1 << 40,
        4 => 1 << 47,
        b => b as u64 * 3 - 8,
    }
}

fn add(world: &mut World, input: &mut Input) {
    let (acc, ai) = world.acc_arg(input);
    let (scaler, si) = world.scaler_arg(input);
    let count = count_arg(input);
    let scale = world.scale_of(si);
    // Build every tensor's gradient from the live accumulator's layout (or a made-up one).
    let (numels, dtypes) = match ai {
        Some(i) => (world.accs[i].numels.clone(), world.accs[i].dtypes.clone()),
        None => (vec![3], vec![GRADACC_DTYPE_F32]),
    };
    let damage = input.u8() % 12;
    let victim = input.below(numels.len());
    let grads: Vec<GradBuf> = numels
        .iter()
        .zip(&dtypes)
        .enumerate()
        .map(|(t, (&numel, &dtype))| {
            make_grad(input, dtype, numel, scale, damage == 1 && t == victim)
        })
        .collect();
    let mut ptrs: Vec<*const c_void> = grads.iter().map(|g| g.ptr()).collect();
    let misaligned = damage == 1;
    let mut n_arg = ptrs.len();
    let mut grads_ptr = ptrs.as_ptr();
    let mut args_ok = !misaligned;
    match damage {
        2 => {
            ptrs[victim] = null();
            grads_ptr = ptrs.as_ptr();
            args_ok = false;
        }
        3 => {
            grads_ptr = null();
            args_ok = false;
        }
        4 => {
            n_arg = [0, n_arg.saturating_sub(1), n_arg + 1, usize::MAX][input.below(4)];
            args_ok = n_arg == ptrs.len();
            if n_arg > ptrs.len() {
                // never let the library read past the array: a longer count must be refused first
                ptrs.resize(n_arg.min(ptrs.len() + 1), null());
                grads_ptr = ptrs.as_ptr();
            }
        }
        _ => {}
    }
    // Half the calls are the typed add: each gradient with its dtype and length, one of which
    // may be wrong (another dtype, a code that is none, another length).
    let typed = input.u8() % 2 == 0;
    let st = if typed {
        let mut descs: Vec<gradacc_grad_t> = ptrs
            .iter()
            .enumerate()
            .map(|(t, &data)| gradacc_grad_t {
                data,
                numel: numels.get(t).map_or(0, |&n| n as u64),
                dtype: dtypes.get(t).copied().unwrap_or(GRADACC_DTYPE_F32),
            })
            .collect();
        if let Some(d) = descs.get_mut(victim) {
            match input.u8() % 8 {
                0 => {
                    d.dtype = [GRADACC_DTYPE_F32, GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16, 3, -1]
                        .into_iter()
                        .filter(|&c| c != d.dtype)
                        .nth(input.below(4))
                        .unwrap_or(3);
                    args_ok = false;
                }
                1 => {
                    d.numel = [0, d.numel.wrapping_sub(1), d.numel + 1, u64::MAX][input.below(4)];
                    args_ok &= d.numel == numels[victim] as u64;
                }
                _ => {}
            }
        }
        let descs_ptr = if grads_ptr.is_null() { null() } else { descs.as_ptr() };
        unsafe { gradacc_accumulator_add_grads(acc, scaler, descs_ptr, n_arg, count) }
    } else {
        unsafe { gradacc_accumulator_add(acc, scaler, grads_ptr, n_arg, count) }
    };
    let ok_now = match (ai, si) {
        (Some(i), Some(_)) => {
            let a = &world.accs[i];
            args_ok && !matches!(a.w.phase, Phase::InMicrobatch(_)) && a.count_ok(count)
        }
        _ => false,
    };
    let name = if typed { "gradacc_accumulator_add_grads" } else { "gradacc_accumulator_add" };
    if world.check(name, st, ok_now) {
        let a = &mut world.accs[ai.unwrap()];
        a.restart_if_synced();
        for (t, g) in grads.iter().enumerate() {
            a.contribute(t, &g.decoded, scale, count);
        }
        a.w.count += count;
        a.w.microbatches += 1;
        a.w.phase = Phase::Open;
    }
}

fn begin(world: &mut World, input: &mut Input) {
    let (acc, ai) = world.acc_arg(input);
    let count = count_arg(input);
    let st = unsafe { gradacc_accumulator_begin_microbatch(acc, count) };
    let want = ai.is_some_and(|i| {
        let a = &world.accs[i];
        !matches!(a.w.phase, Phase::InMicrobatch(_)) && a.count_ok(count)
    });
    if world.check("gradacc_accumulator_begin_microbatch", st, want) {
        let a = &mut world.accs[ai.unwrap()];
        a.restart_if_synced();
        a.w.phase = Phase::InMicrobatch(count);
    }
}

fn add_tensor(world: &mut World, input: &mut Input) {
    let (acc, ai) = world.acc_arg(input);
    let (scaler, si) = world.scaler_arg(input);
    let scale = world.scale_of(si);
    let ntensors = ai.map_or(1, |i| world.accs[i].numels.len());
    let mut index = input.below(ntensors);
    let mut index_ok = true;
    if input.u8() % 10 == 0 {
        index = [ntensors, usize::MAX, ntensors + 1][input.below(3)];
        index_ok = false;
    }
    let (numel, dtype) = match ai {
        Some(i) if index_ok => (world.accs[i].numels[index], world.accs[i].dtypes[index]),
        _ => (2, GRADACC_DTYPE_F16),
    };
    let damage = input.u8() % 10;
    let misalign = damage == 1;
    let g = make_grad(input, dtype, numel, scale, misalign);
    let mut numel_arg = numel;
    let mut ptr = g.ptr();
    let mut args_ok = !misalign;
    match damage {
        2 => {
            ptr = null();
            args_ok = false;
        }
        3 => {
            numel_arg = [0, numel - 1, numel + 1, usize::MAX][input.below(4)];
            args_ok = numel_arg == numel;
        }
        _ => {}
    }
    let st = unsafe { gradacc_accumulator_add_tensor(acc, scaler, index, ptr, numel_arg) };
    let want = args_ok
        && index_ok
        && si.is_some()
        && ai.is_some_and(|i| matches!(world.accs[i].w.phase, Phase::InMicrobatch(_)));
    if world.check("gradacc_accumulator_add_tensor", st, want) {
        let a = &mut world.accs[ai.unwrap()];
        let Phase::InMicrobatch(count) = a.w.phase else { unreachable!() };
        a.contribute(index, &g.decoded, scale, count);
    }
}

fn end(world: &mut World, input: &mut Input) {
    let (acc, ai) = world.acc_arg(input);
    let st = unsafe { gradacc_accumulator_end_microbatch(acc) };
    let want = ai.is_some_and(|i| matches!(world.accs[i].w.phase, Phase::InMicrobatch(_)));
    if world.check("gradacc_accumulator_end_microbatch", st, want) {
        let a = &mut world.accs[ai.unwrap()];
        let Phase::InMicrobatch(count) = a.w.phase else { unreachable!() };
        a.w.count += count;
        a.w.microbatches += 1;
        a.w.phase = Phase::Open;
    }
}

fn sync(world: &mut World, input: &mut Input) {
    let (acc, ai) = world.acc_arg(input);
    // Only single-rank groups: a rank of a larger group would wait for its peers. An aborted
    // group fails the sync (COMM_FAILURE) and leaves the window as it was.
    let (comm, comm_ok, aborted) = match input.u8() % 8 {
        0 => {
            let (c, ci) = world.comm_arg(input);
            match ci {
                Some(k) if world.comms[k].size > 1 => (null_mut(), true, false),
                Some(k) => {
                    (c, !world.aborted[world.comms[k].group], world.aborted[world.comms[k].group])
                }
                None => (c, c.is_null(), false),
            }
        }
        1 | 2 => match world.comms.iter().find(|c| c.size == 1) {
            Some(c) => (c.handle, !world.aborted[c.group], world.aborted[c.group]),
            None => (null_mut(), true, false),
        },
        _ => (null_mut(), true, false),
    };
    let want_info = input.u8() % 8 != 0;
    let mut info = gradacc_sync_info_t {
        struct_size: std::mem::size_of::<gradacc_sync_info_t>(),
        found_inf: false,
        total_count: 7,
        microbatches: 7,
        grad_norm: -1.0,
        clip_coef: -1.0,
        dropped_microbatches: 7,
        overflow_at: 7,
        overflow_rank: 7,
        overflow_microbatch: 7,
        overflow_tensor: 7,
    };
    let st = unsafe {
        gradacc_accumulator_sync(acc, comm, if want_info { &mut info } else { null_mut() })
    };
    // What the sync gives on a healthy communicator.
    let healthy = ai.and_then(|i| {
        let a = &world.accs[i];
        let (count, mbs, ranks) = match a.w.phase {
            Phase::InMicrobatch(_) => return None,
            Phase::Synced(_) => (0, 0, 1), // a sync after a sync: an empty window on the only rank
            _ => (a.w.count, a.w.microbatches, a.w.ranks.max(1)),
        };
        if mbs == 0 {
            return None;
        }
        let divisor = match a.normalize {
            GRADACC_NORMALIZE_BY_COUNT => count,
            GRADACC_NORMALIZE_BY_MICROBATCHES => mbs,
            // The rank-windows the window sums: merges count the ranks that did the work.
            GRADACC_NORMALIZE_BY_WORLD => ranks,
            _ => 1,
        };
        (divisor != 0).then_some(divisor)
    });
    let expected = healthy.filter(|_| comm_ok);
    if !world.check("gradacc_accumulator_sync", st, expected.is_some()) {
        if healthy.is_some() && aborted {
            assert_eq!(
                st,
                GRADACC_STATUS_COMM_FAILURE,
                "sync on an aborted communicator: {}",
                last_error()
            );
        }
        if want_info {
            assert_eq!(info.total_count, 7, "sync wrote its output on failure");
        }
        return;
    }
    let divisor = expected.unwrap();
    let a = &mut world.accs[ai.unwrap()];
    // Unwritten tensors read as zero.
    for t in 0..a.numels.len() {
        if !a.w.written[t] {
            for i in a.tensor(t) {
                a.w.sim[i] = 0.0;
                a.w.exact[i] = 0.0;
                a.w.magnitude[i] = 0.0;
                a.w.adds[i] = 0;
                a.w.raw[i] = 0.0;
            }
        }
    }
    let sum_sq: f64 = a.w.sim.iter().map(|&v| v as f64 * v as f64).sum();
    let norm = sum_sq.sqrt() / divisor as f64;
    // A non-finite gradient is an overflow even where no add saw one (a merge's f32 sum).
    a.w.found_inf |= !norm.is_finite();
    if want_info {
        assert_eq!(info.found_inf, a.w.found_inf, "found_inf");
        assert_eq!(info.total_count, a.w.count, "total_count");
        assert_eq!(info.microbatches, a.w.microbatches, "microbatches");
        // SKIP_STEP drops nothing; a finite window has no place (a window restored with a
        // non-finite value has one it cannot locate: none either).
        assert_eq!(info.dropped_microbatches, 0, "dropped_microbatches");
        assert!(
            info.found_inf || info.overflow_at == GRADACC_OVERFLOW_AT_NONE,
            "a finite window reports an overflow at {}",
            info.overflow_at
        );
        let same = (info.grad_norm - norm).abs() <= 1e-12 * norm.abs() + 1e-300
            || (!norm.is_finite() && !info.grad_norm.is_finite())
            || info.grad_norm == norm;
        assert!(same, "grad_norm {} vs model {}", info.grad_norm, norm);
    }
    // The library's own norm decides the clip, so the factor is the same bits as the library's.
    let lib_norm = if want_info { info.grad_norm } else { norm };
    let max = a.max_grad_norm as f64;
    let clip =
        if max > 0.0 && lib_norm.is_finite() { (max / (lib_norm + 1e-6)).min(1.0) } else { 1.0 };
    if want_info {
        assert!(
            info.clip_coef == clip || (info.clip_coef - clip).abs() <= 1e-12,
            "clip_coef {} vs {}",
            info.clip_coef,
            clip
        );
    }
    let factor = (clip / divisor as f64) as f32;
    for t in 0..a.numels.len() {
        let mut p: *mut f32 = null_mut();
        let mut len = 0usize;
        assert_eq!(
            unsafe { gradacc_accumulator_master(a.handle, t, &mut p, &mut len) },
            GRADACC_STATUS_OK
        );
        assert_eq!(len, a.numels[t]);
        let got = unsafe { std::slice::from_raw_parts(p, len) };
        for (k, &v) in got.iter().enumerate() {
            let i = a.offsets[t] + k;
            let sim = if factor != 1.0 { a.w.sim[i] * factor } else { a.w.sim[i] };
            assert!(
                v.to_bits() == sim.to_bits() || (v.is_nan() && sim.is_nan()),
                "tensor {t} element {k}: library {v:e}, f32 model {sim:e}"
            );
            if !a.w.found_inf && a.w.exact[i].is_finite() && sim.is_finite() {
                let exact = a.w.exact[i] * clip / divisor as f64;
                let bound = (a.w.magnitude[i] * clip / divisor as f64) * (a.w.adds[i] as f64 + 3.0) * f32::EPSILON as f64
                    + (a.w.raw[i] * clip / divisor as f64 + a.w.adds[i] as f64 + 2.0) * 1e-44
                    // a subnormal clip-and-normalise factor (a huge norm clipped to a small one)
                    + a.w.magnitude[i] * 1e-44;
                assert!(
                    (v as f64 - exact).abs() <= bound,
                    "tensor {t} element {k}: library {v:e}, exact {exact:e}, bound {bound:e}"
                );
            }
            a.w.sim[i] = v;
        }
    }
    a.w.phase = Phase::Synced(a.w.found_inf);
    a.syncs += 1;
    world.syncs_checked += 1;
}

fn update(world: &mut World, input: &mut Input) {
    let (scaler, si) = world.scaler_arg(input);
    let n = input.below(4);
    let mut handles = Vec::new();
    let mut all_synced = true;
    let mut found_inf = false;
    for _ in 0..n {
        let (h, ai) = world.acc_arg(input);
        handles.push(h as *const gradacc_accumulator_t);
        match ai.map(|i| world.accs[i].w.phase) {
            Some(Phase::Synced(f)) => found_inf |= f,
            _ => all_synced = false,
        }
    }
    let null_list = input.u8() % 16 == 0;
    let absurd_n = input.u8() % 32 == 0;
    let n_arg = if absurd_n { absurd_len(input, size_of::<*const c_void>()) } else { n };
    let mut skipped = false;
    let want_skipped = input.u8() % 8 != 0;
    let st = unsafe {
        gradacc_scaler_update(
            scaler,
            if null_list { null() } else { handles.as_ptr() },
            n_arg,
            if want_skipped { &mut skipped } else { null_mut() },
        )
    };
    let next = si.and_then(|i| world.scalers[i].1.update(found_inf));
    let list_ok = !null_list && !absurd_n && n > 0;
    let want = si.is_some() && list_ok && all_synced && next.is_some();
    let at_minimum = si.is_some() && list_ok && all_synced && next.is_none();
    if world.check("gradacc_scaler_update", st, want) {
        world.scalers[si.unwrap()].1 = next.unwrap();
        if want_skipped {
            assert_eq!(skipped, found_inf);
        }
    } else if at_minimum {
        assert_eq!(st, GRADACC_STATUS_SCALE_AT_MINIMUM, "{}", last_error());
    }
}

fn reset(world: &mut World, input: &mut Input) {
    let (acc, ai) = world.acc_arg(input);
    let st = unsafe { gradacc_accumulator_reset(acc) };
    if world.check("gradacc_accumulator_reset", st, ai.is_some()) {
        let a = &mut world.accs[ai.unwrap()];
        a.w = a.fresh_window();
    }
}

fn save_window(world: &mut World, input: &mut Input) {
    let (acc, ai) = world.acc_arg(input);
    let ok_state = ai.is_some_and(|i| matches!(world.accs[i].w.phase, Phase::Empty | Phase::Open));
    let mut need = 0usize;
    let st = unsafe { gradacc_accumulator_save_window(acc, null_mut(), 0, &mut need) };
    if !world.check("gradacc_accumulator_save_window", st, ok_state) {
        return;
    }
    let short = input.u8() % 8 == 0;
    let mut buf = vec![0u8; need];
    let mut len = 0usize;
    let capacity = if short { need - 1 } else { need };
    let null_len = input.u8() % 16 == 0;
    let st = unsafe {
        gradacc_accumulator_save_window(
            acc,
            buf.as_mut_ptr(),
            capacity,
            if null_len { null_mut() } else { &mut len },
        )
    };
    if world.check("gradacc_accumulator_save_window", st, !short && !null_len) {
        assert_eq!(len, need);
        world.windows.push(buf);
        if world.windows.len() > 6 {
            world.windows.remove(0);
        }
    }
}

fn load_window(world: &mut World, input: &mut Input) {
    let (acc, ai) = world.acc_arg(input);
    let (bytes, damage) = window_bytes(world, input);
    let null_bytes = input.u8() % 16 == 0;
    let absurd = input.u8() % 32 == 0;
    let len = if absurd { absurd_len(input, 1) } else { bytes.len() };
    let st = unsafe {
        gradacc_accumulator_load_window(acc, if null_bytes { null() } else { bytes.as_ptr() }, len)
    };
    let decoded = ai.and_then(|i| {
        let a = &world.accs[i];
        if null_bytes
            || absurd
            || matches!(a.w.phase, Phase::InMicrobatch(_))
            || damage == Some(usize::MAX)
        {
            return None;
        }
        // The saved layout field must equal this accumulator's layout fingerprint.
        let same = bytes
            .get(8..16)
            .is_some_and(|f| u64::from_le_bytes(f.try_into().unwrap()) == layout_hash(a));
        decode_window(&bytes, a, same)
    });
    if world.check("gradacc_accumulator_load_window", st, decoded.is_some()) {
        world.accs[ai.unwrap()].w = decoded.unwrap();
    }
}

/// Bytes to load or merge: a window the sequence saved, or a few random bytes; then damaged or not
/// (the `mutate` verdict).
fn window_bytes(world: &World, input: &mut Input) -> (Vec<u8>, Option<usize>) {
    let mut bytes = if world.windows.is_empty() || input.u8() % 16 == 0 {
        (0..input.below(64)).map(|_| input.u8()).collect::<Vec<u8>>()
    } else {
        world.windows[input.below(world.windows.len())].clone()
    };
    let damage = mutate(input, &mut bytes);
    (bytes, damage)
}

/// The rank-windows after a saved window of `saved` merges into `w`: into this rank's own window
/// with nothing in it yet the saved one is the window; otherwise both count (a synced window
/// starts anew first).
fn ranks_after_merge(w: &Window, saved: u64) -> u64 {
    let (ranks, microbatches) =
        if matches!(w.phase, Phase::Synced(_)) { (0, 0) } else { (w.ranks, w.microbatches) };
    if ranks == 0 && microbatches == 0 {
        saved
    } else {
        ranks.max(1) + saved
    }
}

fn merge_window(world: &mut World, input: &mut Input) {
    let (acc, ai) = world.acc_arg(input);
    let (bytes, damage) = window_bytes(world, input);
    let null_bytes = input.u8() % 16 == 0;
    let st = unsafe {
        gradacc_accumulator_merge_window(
            acc,
            if null_bytes { null() } else { bytes.as_ptr() },
            bytes.len(),
        )
    };
    let saved = ai.and_then(|i| {
        let a = &world.accs[i];
        if null_bytes || matches!(a.w.phase, Phase::InMicrobatch(_)) || damage == Some(usize::MAX) {
            return None;
        }
        let same = bytes
            .get(8..16)
            .is_some_and(|f| u64::from_le_bytes(f.try_into().unwrap()) == layout_hash(a));
        let saved = decode_window(&bytes, a, same)?;
        // The saved items join the window's total, which must stay within its limit; an empty
        // saved window (0 items) merges as nothing.
        let microbatches = if matches!(a.w.phase, Phase::Synced(_)) { 0 } else { a.w.microbatches };
        // The rank-windows after the merge stay within what a saved window may hold.
        let ranks = ranks_after_merge(&a.w, saved.ranks);
        ((saved.count == 0 || a.count_ok(saved.count))
            && microbatches.checked_add(saved.microbatches).is_some()
            && ranks <= 1 << 32)
            .then_some(saved)
    });
    if !world.check("gradacc_accumulator_merge_window", st, saved.is_some()) {
        return;
    }
    let saved = saved.unwrap();
    let a = &mut world.accs[ai.unwrap()];
    let ranks = ranks_after_merge(&a.w, saved.ranks);
    a.restart_if_synced(); // after a sync it starts a new window, as add does
    a.w.ranks = ranks;
    for t in 0..a.numels.len() {
        let range = a.tensor(t);
        match (a.w.written[t], saved.written[t]) {
            (true, true) => {
                for i in range {
                    a.w.sim[i] += saved.sim[i]; // in f32, the current value first
                    a.w.exact[i] += saved.sim[i] as f64;
                    a.w.magnitude[i] += (saved.sim[i] as f64).abs();
                    a.w.adds[i] += 1;
                }
            }
            (false, true) => {
                for i in range {
                    a.w.sim[i] = saved.sim[i];
                    a.w.exact[i] = saved.exact[i];
                    a.w.magnitude[i] = saved.magnitude[i];
                    a.w.adds[i] = saved.adds[i];
                    a.w.raw[i] = 0.0;
                }
                a.w.written[t] = true;
            }
            _ => {}
        }
    }
    a.w.found_inf |= saved.found_inf;
    a.w.count += saved.count;
    a.w.microbatches += saved.microbatches;
    a.w.phase = if a.w.microbatches == 0 { Phase::Empty } else { Phase::Open };
}

fn comm_abort(world: &mut World, input: &mut Input) {
    let (c, ci) = world.comm_arg(input);
    let st = unsafe { gradacc_comm_abort(c) };
    if world.check("gradacc_comm_abort", st, ci.is_some()) {
        let group = world.comms[ci.unwrap()].group;
        world.aborted[group] = true; // again on an aborted group: still OK
    }
}

/// Sets a timeout (valid or not), or reads one back. Any value is safe: no collective here waits.
fn comm_timeout(world: &mut World, input: &mut Input) {
    let (c, ci) = world.comm_arg(input);
    if input.u8() & 1 == 0 {
        let seconds = match input.below(16) {
            0 => f64::NAN,
            1 => f64::INFINITY,
            2 => f64::NEG_INFINITY,
            3 => -1.0,
            4 => -1e-300,
            5 => 1e9 * (1.0 + f64::EPSILON),
            6 => f64::MAX,
            7 => f64::from_bits(input.u64()),
            8 => -0.0,
            9 => 1e-12, // under a nanosecond
            10 => 1e9,
            k => [0.0, 1e-3, 0.05, 2.5, 600.0][k - 11],
        };
        let valid = seconds.is_finite() && (0.0..=1e9).contains(&seconds);
        let st = unsafe { gradacc_comm_set_timeout(c, seconds) };
        if world.check("gradacc_comm_set_timeout", st, ci.is_some() && valid) {
            world.comms[ci.unwrap()].timeout = seconds;
        } else if ci.is_some() {
            assert_eq!(
                st,
                GRADACC_STATUS_INVALID_ARGUMENT,
                "gradacc_comm_set_timeout({seconds}): {}",
                last_error()
            );
        }
    } else {
        let null_out = input.u8() % 16 == 0;
        let mut got = -7.0f64;
        let st = unsafe { gradacc_comm_timeout(c, if null_out { null_mut() } else { &mut got }) };
        if world.check("gradacc_comm_timeout", st, ci.is_some() && !null_out) {
            // Kept in whole nanoseconds.
            let want = world.comms[ci.unwrap()].timeout;
            assert!(
                (got - want).abs() <= 1e-9 + want * 1e-15,
                "timeout {got} read back, {want} set"
            );
        } else {
            assert_eq!(got, -7.0, "gradacc_comm_timeout wrote its output on failure");
        }
    }
}

fn scaler_save(world: &mut World, input: &mut Input) {
    let (s, si) = world.scaler_arg(input);
    let mut need = 0usize;
    let st = unsafe { gradacc_scaler_save(s, null_mut(), 0, &mut need) };
    if !world.check("gradacc_scaler_save", st, si.is_some()) {
        return;
    }
    let short = input.u8() % 8 == 0;
    let mut buf = vec![0u8; need];
    let mut len = 0;
    let st = unsafe {
        gradacc_scaler_save(s, buf.as_mut_ptr(), if short { need / 2 } else { need }, &mut len)
    };
    if world.check("gradacc_scaler_save", st, !short) {
        assert_eq!(
            decode_scaler(&buf),
            Some(world.scalers[si.unwrap()].1),
            "saved scaler state differs from the model"
        );
        world.scaler_states.push(buf);
        if world.scaler_states.len() > 6 {
            world.scaler_states.remove(0);
        }
    }
}

fn scaler_load(world: &mut World, input: &mut Input) {
    let (s, si) = world.scaler_arg(input);
    let mut bytes = if world.scaler_states.is_empty() || input.u8() % 16 == 0 {
        (0..input.below(120)).map(|_| input.u8()).collect::<Vec<u8>>()
    } else {
        world.scaler_states[input.below(world.scaler_states.len())].clone()
    };
    mutate(input, &mut bytes);
    let decoded = decode_scaler(&bytes);
    let absurd = input.u8() % 32 == 0;
    let len = if absurd { absurd_len(input, 1) } else { bytes.len() };
    let st = unsafe { gradacc_scaler_load(s, bytes.as_ptr(), len) };
    if world.check("gradacc_scaler_load", st, si.is_some() && decoded.is_some() && !absurd) {
        world.scalers[si.unwrap()].1 = decoded.unwrap();
    } else if si.is_some() && absurd {
        assert_eq!(st, GRADACC_STATUS_INVALID_ARGUMENT, "{}", last_error());
    } else if si.is_some() {
        assert_eq!(st, GRADACC_STATUS_CORRUPT_STATE, "{}", last_error());
    }
}

fn scale_loss(world: &mut World, input: &mut Input) {
    let (s, si) = world.scaler_arg(input);
    let dtype_raw =
        [GRADACC_DTYPE_F32, GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16, 3, -7][input.below(5)];
    let dtype = if (0..=2).contains(&dtype_raw) { dtype_raw } else { GRADACC_DTYPE_F32 };
    let numel = input.below(5);
    let misalign = input.u8() % 8 == 0;
    let g = make_grad(input, dtype, numel, 1.0, misalign);
    let mut huge = false;
    let numel_arg = if input.u8() % 16 == 0 {
        huge = true;
        usize::MAX / 2
    } else {
        numel
    };
    let null_ptr = input.u8() % 16 == 0;
    let ptr = if null_ptr { null_mut() } else { g.ptr() as *mut c_void };
    let st = unsafe { gradacc_scaler_scale_loss(s, ptr, numel_arg, dtype_raw) };
    let want = si.is_some() && dtype == dtype_raw && !misalign && !huge && !null_ptr;
    if world.check("gradacc_scaler_scale_loss", st, want) && dtype == GRADACC_DTYPE_F32 {
        let scale = world.scalers[si.unwrap()].1.scale;
        let after = unsafe { std::slice::from_raw_parts(ptr as *const f32, numel) };
        for (k, &v) in after.iter().enumerate() {
            let want = g.decoded[k] * scale;
            assert!(
                v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan()),
                "scale_loss element {k}: {v} vs {want}"
            );
        }
    }
}

/// A name argument: one of `names` (valid or nearly), random bytes, or a buffer of 80 letters
/// with no terminator in reach (the library reads at most 65 bytes of it); and its text, where
/// the library can read one (at most 64 printable ASCII characters, then the terminator).
fn name_arg(input: &mut Input, names: &[&'static str]) -> (Vec<u8>, Option<String>) {
    let bytes: Vec<u8> = match input.below(names.len() + 2) {
        i if i < names.len() => names[i].bytes().chain([0]).collect(),
        i if i == names.len() => (0..input.below(12)).map(|_| input.u8()).chain([0]).collect(),
        _ => vec![b'a'; 80],
    };
    let end = bytes.iter().position(|&c| c == 0);
    let text = end
        .filter(|&n| n <= 64 && bytes[..n].iter().all(u8::is_ascii_graphic))
        .map(|n| String::from_utf8(bytes[..n].to_vec()).unwrap());
    (bytes, text)
}

/// The model of an axis list's validity: known names, each once, not mixing the dense view with
/// the expert one (pp belongs to both).
fn axes_valid(list: &str) -> bool {
    let names: Vec<&str> = list.split('-').collect();
    let known = ["tp", "cp", "dp", "pp", "ep", "etp", "edp"];
    let dense = names.iter().any(|n| ["tp", "cp", "dp"].contains(n));
    let expert = names.iter().any(|n| ["ep", "etp", "edp"].contains(n));
    let unique = names.iter().enumerate().all(|(i, n)| !names[..i].contains(n));
    names.iter().all(|n| known.contains(n)) && unique && !(dense && expert)
}

/// A mesh shape with random sizes and rank order, then a group query with random axes: each
/// succeeds exactly when the model says; an in-process communicator is never split.
fn mesh_shape(world: &mut World, input: &mut Input) {
    let sizes: Vec<u32> =
        (0..6).map(|i| [1, 2, 3, 4, 0, 8][input.below(if i == 0 { 6 } else { 5 })]).collect();
    let (w, tp, pp, cp, ep, etp) = (sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5]);
    let orders =
        ["tp-cp-dp-pp", "dp-tp-cp-pp", "pp-dp-cp-tp", "tp-cp-dp", "tp-tp-dp-pp", "tp-cp-dp-ep"];
    let null_order = input.below(3) == 0;
    let (order, known) = name_arg(input, &orders);
    let model = tp * pp * cp;
    let fits = [w, tp, pp, cp, ep, etp].iter().all(|&v| v > 0)
        && w % model == 0
        && (w / pp) % (ep * etp) == 0;
    let dense_permutation = |o: &str| {
        o.split('-').count() == 4 && o.split('-').all(|n| ["tp", "cp", "dp", "pp"].contains(&n))
    };
    let order_ok = null_order || known.is_some_and(|o| axes_valid(&o) && dense_permutation(&o));
    let mut shape: *mut gradacc_mesh_shape_t = 0x11 as *mut _;
    let order_ptr = if null_order { null() } else { order.as_ptr().cast() };
    let st = unsafe { gradacc_mesh_shape_create(w, tp, pp, cp, ep, etp, order_ptr, &mut shape) };
    if !world.check("gradacc_mesh_shape_create", st, fits && order_ok) {
        assert_eq!(shape as usize, 0x11, "gradacc_mesh_shape_create wrote its output on failure");
        return;
    }
    let lists = ["tp", "cp-dp", "dp", "pp", "edp", "ep", "etp-ep", "tp-ep", "dp-dp", "xp"];
    let (axes, known) = name_arg(input, &lists);
    let rank = [0, 1, w - 1, w, u32::MAX][input.below(5)];
    let (mut color, mut key, mut size) = (u32::MAX, u32::MAX, u32::MAX);
    let st = unsafe {
        gradacc_mesh_shape_group(shape, rank, axes.as_ptr().cast(), &mut color, &mut key, &mut size)
    };
    if world.check(
        "gradacc_mesh_shape_group",
        st,
        rank < w && known.is_some_and(|a| axes_valid(&a)),
    ) {
        assert!(size >= 1 && key < size && color <= rank && size <= w, "{color} {key} {size}");
    }
    if let (c, Some(_)) = world.comm_arg(input) {
        let mut out: *mut gradacc_comm_t = 0x11 as *mut _;
        let st = unsafe { gradacc_comm_split(c, 0, 0, &mut out) };
        world.check("gradacc_comm_split", st, false);
        assert_eq!(out as usize, 0x11, "gradacc_comm_split wrote its output on failure");
    }
    let st = unsafe { gradacc_mesh_shape_destroy(shape) };
    world.check("gradacc_mesh_shape_destroy", st, true);
}

fn queries(world: &mut World, input: &mut Input) {
    let null_out = input.u8() % 8 == 0;
    match input.below(6) {
        0 => {
            let (s, si) = world.scaler_arg(input);
            let mut v = -1.0f32;
            let st = unsafe { gradacc_scaler_scale(s, if null_out { null_mut() } else { &mut v }) };
            if world.check("gradacc_scaler_scale", st, si.is_some() && !null_out) {
                assert_eq!(v, world.scalers[si.unwrap()].1.scale, "scale");
            } else {
                assert_eq!(v, -1.0);
            }
        }
        1 => {
            let (s, si) = world.scaler_arg(input);
            let mut v = gradacc_scaler_stats_t {
                struct_size: std::mem::size_of::<gradacc_scaler_stats_t>(),
                steps: 99,
                skipped_steps: 99,
                growths: 99,
                backoffs: 99,
            };
            let st = unsafe { gradacc_scaler_stats(s, if null_out { null_mut() } else { &mut v }) };
            if world.check("gradacc_scaler_stats", st, si.is_some() && !null_out) {
                assert_eq!(
                    [v.steps, v.skipped_steps, v.growths, v.backoffs],
                    world.scalers[si.unwrap()].1.stats,
                    "stats"
                );
            } else {
                assert_eq!(v.steps, 99);
            }
        }
        2 => {
            let (a, ai) = world.acc_arg(input);
            let mut v = 77usize;
            let st = unsafe {
                gradacc_accumulator_num_tensors(a, if null_out { null_mut() } else { &mut v })
            };
            if world.check("gradacc_accumulator_num_tensors", st, ai.is_some() && !null_out) {
                assert_eq!(v, world.accs[ai.unwrap()].numels.len());
            } else {
                assert_eq!(v, 77);
            }
        }
        3 => {
            let (a, ai) = world.acc_arg(input);
            let index = input.below(6);
            let mut p: *mut f32 = 0x3 as *mut f32;
            let mut len = 77usize;
            let st = unsafe {
                gradacc_accumulator_master(
                    a,
                    index,
                    if null_out { null_mut() } else { &mut p },
                    &mut len,
                )
            };
            let want = !null_out && ai.is_some_and(|i| index < world.accs[i].numels.len());
            if world.check("gradacc_accumulator_master", st, want) {
                assert_eq!(len, world.accs[ai.unwrap()].numels[index]);
            } else {
                assert_eq!((p as usize, len), (3, 77));
            }
        }
        4 => {
            let (c, ci) = world.comm_arg(input);
            let mut r = 77i32;
            let mut w = 77i32;
            let st = unsafe { gradacc_comm_rank(c, if null_out { null_mut() } else { &mut r }) };
            if world.check("gradacc_comm_rank", st, ci.is_some() && !null_out) {
                assert_eq!(r as usize, world.comms[ci.unwrap()].rank);
            }
            let st = unsafe { gradacc_comm_world_size(c, &mut w) };
            if world.check("gradacc_comm_world_size", st, ci.is_some()) {
                assert_eq!(w as usize, world.comms[ci.unwrap()].size);
            }
        }
        _ => {
            let code = input.u64() as i32;
            let s = unsafe { CStr::from_ptr(gradacc_status_string(code)) };
            assert!(!s.to_bytes().is_empty());
            let v = unsafe { CStr::from_ptr(gradacc_version_string()) }.to_str().unwrap();
            assert_eq!(v, gradacc::VERSION);
        }
    }
}

fn comm_create(world: &mut World, input: &mut Input) {
    let world_size = [1i32, 1, 2, 3, 0, 4097, -1, i32::MAX][input.below(8)];
    let valid = (1..=4096).contains(&world_size);
    let null_out = input.u8() % 16 == 0;
    if valid && !null_out && world.comms.len() >= 2 * MAX_OBJECTS {
        return;
    }
    let mut out = vec![0x11 as *mut gradacc_comm_t; if valid { world_size as usize } else { 1 }];
    let st = unsafe {
        gradacc_comm_create_local(world_size, if null_out { null_mut() } else { out.as_mut_ptr() })
    };
    if world.check("gradacc_comm_create_local", st, valid && !null_out) {
        let group = world.aborted.len();
        world.aborted.push(false);
        for (rank, handle) in out.into_iter().enumerate() {
            world.comms.push(CommModel {
                handle,
                rank,
                size: world_size as usize,
                group,
                timeout: 600.0,
            });
        }
    } else {
        assert!(
            out.iter().all(|&h| h as usize == 0x11),
            "gradacc_comm_create_local wrote its output on failure"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input { data, pos: 0 };
    let mut world = World {
        scalers: vec![],
        accs: vec![],
        comms: vec![],
        opts: vec![],
        aborted: vec![],
        dead: vec![],
        windows: vec![],
        scaler_states: vec![],
        opt_states: vec![],
        calls: 0,
        syncs_checked: 0,
        opt_steps: 0,
        adopted_steps: 0,
    };
    while !input.done() && world.calls < 400 {
        let call = input.u8();
        if call >= 230 {
            optimizer::optimizer_call(&mut world, &mut input);
            continue;
        }
        match call % 23 {
            0 | 1 => scaler_create(&mut world, &mut input),
            2 | 3 => acc_create(&mut world, &mut input),
            4 => destroy(&mut world, &mut input),
            5 | 6 => add(&mut world, &mut input),
            7 => begin(&mut world, &mut input),
            8 | 9 => add_tensor(&mut world, &mut input),
            10 => end(&mut world, &mut input),
            11 | 12 => sync(&mut world, &mut input),
            13 => update(&mut world, &mut input),
            14 => reset(&mut world, &mut input),
            15 => save_window(&mut world, &mut input),
            16 => load_window(&mut world, &mut input),
            17 => {
                if input.u8() & 1 == 0 {
                    scaler_save(&mut world, &mut input)
                } else {
                    scaler_load(&mut world, &mut input)
                }
            }
            18 => scale_loss(&mut world, &mut input),
            19 => merge_window(&mut world, &mut input),
            20 => comm_abort(&mut world, &mut input),
            21 => comm_timeout(&mut world, &mut input),
            _ => match input.u8() % 8 {
                0 | 1 => comm_create(&mut world, &mut input),
                2 => mesh_shape(&mut world, &mut input),
                _ => queries(&mut world, &mut input),
            },
        }
    }
    if std::env::var_os("GRADACC_FUZZ_STATS").is_some() {
        eprintln!(
            "gradacc-fuzz-stats calls={} syncs_checked={} optimizer_steps={} adopted_steps={}",
            world.calls, world.syncs_checked, world.opt_steps, world.adopted_steps
        );
    }
    // Every object goes, so runs do not pile objects up; each destroy must succeed once and only
    // once.
    for (h, _) in world.scalers.drain(..) {
        assert_eq!(unsafe { gradacc_scaler_destroy(h) }, GRADACC_STATUS_OK);
        assert_eq!(unsafe { gradacc_scaler_destroy(h) }, GRADACC_STATUS_INVALID_HANDLE);
    }
    for a in world.accs.drain(..) {
        assert_eq!(unsafe { gradacc_accumulator_destroy(a.handle) }, GRADACC_STATUS_OK);
        assert_eq!(unsafe { gradacc_accumulator_destroy(a.handle) }, GRADACC_STATUS_INVALID_HANDLE);
    }
    for c in world.comms.drain(..) {
        assert_eq!(unsafe { gradacc_comm_destroy(c.handle) }, GRADACC_STATUS_OK);
    }
    // After their accumulators: an optimizer outlives the accumulator it was made over.
    for o in world.opts.drain(..) {
        assert_eq!(unsafe { gradacc_optimizer_destroy(o.handle) }, GRADACC_STATUS_OK);
        assert_eq!(unsafe { gradacc_optimizer_destroy(o.handle) }, GRADACC_STATUS_INVALID_HANDLE);
    }
});

mod optimizer;
