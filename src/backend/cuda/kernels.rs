//! The compiled kernels of one device: compiled by NVRTC once per device per process, at the first
//! object created on the device, loaded once per primary context (again after a reset of it, from
//! the same image), and looked up once, so a launch is a field access.

use std::ffi::CString;
use std::sync::Arc;

use parking_lot::Mutex;

use super::compile;
use super::driver::{Context, Function, Module};
use crate::error::Result;

/// Every kernel of [`compile::KERNELS`], loaded in one device's primary context.
pub struct Kernels {
    _module: Module,
    /// The compiled image, kept to load again into a reset context.
    image: Arc<[u8]>,
    pub add_multi: Function,
    pub add_one: Function,
    pub check_multi: Function,
    pub merge: Function,
    pub count_flags: Function,
    pub pack_control: Function,
    pub or_flag: Function,
    pub to_bf16: Function,
    pub sum_bf16: Function,
    pub begin_boundary: Function,
    pub scale_sum_squares: Function,
    pub segment_squares: Function,
    pub finish_norm: Function,
    pub scale_by: Function,
    pub scaler_gather: Function,
    pub scaler_update: Function,
    pub scale_loss: Function,
    pub opt_step: Function,
    pub opt_advance: Function,
    pub claim_schedule: Function,
    pub opt_copy: Function,
    pub layout_sizes: Function,
}

impl Kernels {
    /// The kernels of `ctx`'s device, loaded in `ctx`, compiling them on first use.
    pub fn of(ctx: &Context) -> Result<Arc<Kernels>> {
        // (device ordinal, context id, kernels): one entry per device, for its current context.
        static LOADED: Mutex<Vec<(i32, u64, Arc<Kernels>)>> = Mutex::new(Vec::new());
        let mut loaded = LOADED.lock();
        let entry = loaded.iter().position(|(ordinal, _, _)| *ordinal == ctx.ordinal);
        if let Some((_, id, k)) = entry.map(|i| &loaded[i]) {
            if *id == ctx.id {
                return Ok(k.clone());
            }
        }
        // A new context for the device (its primary context was reset): the same image again.
        let image = match entry.map(|i| loaded.remove(i)) {
            Some((_, _, k)) => k.image.clone(),
            None => {
                let (major, minor) = ctx.capability;
                compile::compile(compile::Target::for_device(major, minor)?)?.image.into()
            }
        };
        let module = Module::load(ctx, &image)?;
        // cuModuleGetFunction, like every driver call on a context's objects, needs it current.
        let _current = ctx.enter()?;
        let f =
            |name: &str| module.function(&CString::new(name).expect("kernel names have no NUL"));
        let k = Arc::new(Kernels {
            add_multi: f("ga_add_multi")?,
            add_one: f("ga_add_one")?,
            check_multi: f("ga_check_multi")?,
            merge: f("ga_merge")?,
            count_flags: f("ga_count_flags")?,
            pack_control: f("ga_pack_control")?,
            or_flag: f("ga_or_flag")?,
            to_bf16: f("ga_to_bf16")?,
            sum_bf16: f("ga_sum_bf16")?,
            begin_boundary: f("ga_begin_boundary")?,
            scale_sum_squares: f("ga_scale_sum_squares")?,
            segment_squares: f("ga_segment_squares")?,
            finish_norm: f("ga_finish_norm")?,
            scale_by: f("ga_scale_by")?,
            scaler_gather: f("ga_scaler_gather")?,
            scaler_update: f("ga_scaler_update")?,
            scale_loss: f("ga_scale_loss")?,
            opt_step: f("ga_opt_step")?,
            opt_advance: f("ga_opt_advance")?,
            claim_schedule: f("ga_claim_schedule")?,
            opt_copy: f("ga_opt_copy")?,
            layout_sizes: f("ga_layout_sizes")?,
            _module: module,
            image,
        });
        loaded.push((ctx.ordinal, ctx.id, k.clone()));
        Ok(k)
    }
}
