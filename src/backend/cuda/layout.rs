//! Rust twins of the structs the kernels read and write (kernels/kernels.cu, kernels/math.cuh).
//! Fixed-width fields in the same order; the GPU suite compares the sizes with the device's.

/// `ga_tensor`: one tensor's place in the flat master.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GaTensor {
    pub offset: u64,
    pub numel: u64,
    pub dtype: i32,
    pub pad: i32,
}

/// `ga_chunk`: a piece of one tensor handled by one thread block of a multi-tensor launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GaChunk {
    pub tensor: u64,
    pub start: u64,
    pub len: u64,
}

/// `ga_source`: one tensor's gradient address in a micro-batch, and whether it assigns.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GaSource {
    pub grad: u64,
    pub assign: u32,
    pub pad: u32,
}

/// Sources per `ga_add_multi` launch (`GA_SOURCES_PER_LAUNCH`): they travel as a kernel parameter,
/// and a launch's parameters may hold 4 KB on every driver: `ga_add_multi`'s take 3,656 bytes,
/// leaving a margin.
pub const SOURCES_PER_LAUNCH: usize = 224;

/// `ga_add_multi`'s parameters: seven 8-byte ones beside the sources.
const ADD_MULTI_PARAMS: usize = 7 * 8 + std::mem::size_of::<GaSources>();
const _: () =
    assert!(ADD_MULTI_PARAMS <= 4096 - 256, "ga_add_multi's parameters must stay well inside 4 KB");

/// `ga_sources`: the gradients of consecutive tensors, passed by value to `ga_add_multi`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GaSources {
    pub first_tensor: u64,
    pub count: u64,
    pub s: [GaSource; SOURCES_PER_LAUNCH],
}

/// The leading u64 words of a `ga_boundary` that the ranks sum: count, micro-batches, found_inf,
/// ranks, dropped.
pub const CONTROL_WORDS: usize = 5;

/// The word after them, `first_bad`: the complement of the first non-finite place's key, which
/// the ranks reduce with MAX (under DROP_MICROBATCH) to agree on the smallest key.
pub const FIRST_BAD_WORD: usize = CONTROL_WORDS;

/// `ga_boundary`: control values (reduced across ranks) and the boundary's results.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GaBoundary {
    pub count: u64,
    pub microbatches: u64,
    pub found_inf: u64,
    pub ranks: u64,
    pub dropped: u64,
    pub first_bad: u64,
    pub divisor: u64,
    pub grad_norm: f64,
    pub clip_coef: f64,
    pub second_factor: f32,
    pub empty: u32,
    pub pad: u32,
}

/// `ga_scaler_state`: the scaler's state in device memory.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GaScalerState {
    pub scale: f32,
    pub growth_tracker: u32,
    pub hysteresis_tracker: u32,
    pub at_minimum: u32,
    pub steps: u64,
    pub skipped_steps: u64,
    pub growths: u64,
    pub backoffs: u64,
    pub last_skipped: u32,
    pub pending_found_inf: u32,
}

/// `ga_scaler_rule`: the scaler's configuration, passed by value to the update kernel.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GaScalerRule {
    pub growth_factor: f32,
    pub backoff_factor: f32,
    pub min_scale: f32,
    pub max_scale: f32,
    pub growth_interval: u32,
    pub hysteresis: u32,
    pub consecutive_hysteresis: u32,
    pub dynamic: u32,
}

/// `ga_opt_rule`: an optimizer's hyperparameters and rounding, passed by value (the learning rate
/// is a device value of its own).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GaOptRule {
    /// `GA_OPT_ADAMW` (1) or `GA_OPT_SGD` (2).
    pub algorithm: u32,
    pub nesterov: u32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub momentum: f32,
    pub dampening: f32,
    /// `GA_ROUND_NEAREST` (0) or `GA_ROUND_STOCHASTIC` (1).
    pub rounding: u32,
    pub seed: u64,
    /// `GA_MASTERS_F32` (0), `GA_MASTERS_REMAINDER` (1) or `GA_MASTERS_NONE` (2).
    pub masters: u32,
    /// `GA_MOMENTS_F32` (0) or `GA_MOMENTS_BF16` (1).
    pub moments: u32,
    pub moment_seed: u64,
}

/// `ga_opt_tensor`: one tensor's options in the optimizer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GaOptTensor {
    pub lr_scale: f32,
    pub decays: u32,
    pub dtype: i32,
    pub pad: u32,
}

/// `ga_opt_chunk`: a piece of one tensor; `at` is its held index (the step) or its byte offset
/// in the all-gather's staging (the copies).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GaOptChunk {
    pub tensor: u64,
    pub start: u64,
    pub len: u64,
    pub at: u64,
}

/// `ga_weights`: the model weights' addresses of consecutive tensors, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GaWeights {
    pub first_tensor: u64,
    pub count: u64,
    pub w: [u64; SOURCES_PER_LAUNCH],
}

/// `ga_opt_step`'s parameters: eleven 8-byte ones beside the weights and the rule.
const OPT_STEP_PARAMS: usize =
    11 * 8 + std::mem::size_of::<GaWeights>() + std::mem::size_of::<GaOptRule>();
const _: () =
    assert!(OPT_STEP_PARAMS <= 4096 - 256, "ga_opt_step's parameters must stay well inside 4 KB");

/// The sizes `ga_layout_sizes` writes, in its order.
pub const SIZES: [usize; 11] = [
    std::mem::size_of::<GaTensor>(),
    std::mem::size_of::<GaChunk>(),
    std::mem::size_of::<GaSource>(),
    std::mem::size_of::<GaBoundary>(),
    std::mem::size_of::<GaScalerState>(),
    std::mem::size_of::<GaScalerRule>(),
    std::mem::size_of::<GaSources>(),
    std::mem::size_of::<GaOptRule>(),
    std::mem::size_of::<GaOptTensor>(),
    std::mem::size_of::<GaOptChunk>(),
    std::mem::size_of::<GaWeights>(),
];
