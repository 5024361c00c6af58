//! The compiled kernels of one device: compiled by NVRTC and loaded once per device per process,
//! at the first object created on the device.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex};

use super::compile;
use super::driver::{Context, Function, Module};
use crate::error::{Error, ErrorKind, Result};

/// Every kernel of [`compile::KERNELS`], loaded in one device's primary context.
pub struct Kernels {
    _module: Module,
    functions: HashMap<&'static str, Function>,
}

impl Kernels {
    /// The kernels of `ctx`'s device, compiling them on first use.
    pub fn of(ctx: &Context) -> Result<Arc<Kernels>> {
        static LOADED: Mutex<Vec<(i32, Arc<Kernels>)>> = Mutex::new(Vec::new());
        let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, k)) = loaded.iter().find(|(ordinal, _)| *ordinal == ctx.ordinal) {
            return Ok(k.clone());
        }
        let (major, minor) = ctx.capability;
        let compiled = compile::compile(compile::Target::for_device(major, minor)?)?;
        let module = Module::load(ctx, &compiled.image)?;
        let mut functions = HashMap::new();
        for name in compile::KERNELS {
            let c_name = CString::new(name).expect("kernel names have no NUL");
            functions.insert(name, module.function(&c_name)?);
        }
        let k = Arc::new(Kernels { _module: module, functions });
        loaded.push((ctx.ordinal, k.clone()));
        Ok(k)
    }

    pub fn get(&self, name: &str) -> Result<Function> {
        self.functions.get(name).copied().ok_or_else(|| Error::new(ErrorKind::Internal, format!("kernel {name} is not loaded")))
    }
}
