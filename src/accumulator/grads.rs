//! A micro-batch's gradients as the caller hands them ([`Grads`], one tensor's: [`Gradient`]),
//! host slices or device addresses, and the checks that a gradient fits its tensor and the
//! accumulator's memory before anything reads it.

use std::ffi::c_void;

use super::{Accumulator, TensorDesc};
use crate::device::{Device, DevicePtr};
use crate::dtype::{self, Grad};
use crate::error::{Error, ErrorKind, Result};

/// One micro-batch's gradients, tensor by tensor, in the accumulator's memory: host slices for
/// the CPU, device addresses (each holding its tensor's declared numel and dtype) for CUDA.
#[derive(Clone, Copy, Debug)]
pub enum Grads<'a> {
    Host(&'a [Grad<'a>]),
    Device(&'a [DevicePtr]),
}

impl<'a> From<&'a [Grad<'a>]> for Grads<'a> {
    fn from(g: &'a [Grad<'a>]) -> Self {
        Grads::Host(g)
    }
}

impl<'a> From<&'a Vec<Grad<'a>>> for Grads<'a> {
    fn from(g: &'a Vec<Grad<'a>>) -> Self {
        Grads::Host(g)
    }
}

impl<'a, const N: usize> From<&'a [Grad<'a>; N]> for Grads<'a> {
    fn from(g: &'a [Grad<'a>; N]) -> Self {
        Grads::Host(g)
    }
}

impl<'a> From<&'a [DevicePtr]> for Grads<'a> {
    fn from(g: &'a [DevicePtr]) -> Self {
        Grads::Device(g)
    }
}

impl<'a, const N: usize> From<&'a [DevicePtr; N]> for Grads<'a> {
    fn from(g: &'a [DevicePtr; N]) -> Self {
        Grads::Device(g)
    }
}

impl<'a> From<&'a Vec<DevicePtr>> for Grads<'a> {
    fn from(g: &'a Vec<DevicePtr>) -> Self {
        Grads::Device(g)
    }
}

impl<'a> Grads<'a> {
    pub(super) fn len(&self) -> usize {
        match self {
            Grads::Host(g) => g.len(),
            Grads::Device(g) => g.len(),
        }
    }

    /// The host gradients a CPU store reads (the accumulator checked the device already).
    pub(crate) fn host(self) -> Result<&'a [Grad<'a>]> {
        match self {
            Grads::Host(g) => Ok(g),
            Grads::Device(_) => Err(wrong_memory("device addresses", "the CPU")),
        }
    }

    /// The device addresses a device store reads.
    pub(crate) fn device(self) -> Result<&'a [DevicePtr]> {
        match self {
            Grads::Device(g) => Ok(g),
            Grads::Host(_) => Err(wrong_memory("host gradients", "a device")),
        }
    }

    /// Tensor `index`'s gradient.
    pub(super) fn get(&self, index: usize) -> Gradient<'_> {
        match self {
            Grads::Host(g) => Gradient::Host(g[index]),
            Grads::Device(g) => Gradient::Device(g[index]),
        }
    }
}

/// One tensor's gradient (one contribution of `add_tensor`), in the accumulator's memory.
#[derive(Clone, Copy, Debug)]
pub enum Gradient<'a> {
    Host(Grad<'a>),
    /// A device address holding the tensor's declared numel values of its dtype.
    Device(DevicePtr),
}

impl<'a> Gradient<'a> {
    /// The host gradient a CPU store reads (the accumulator checked the device already).
    pub(crate) fn host(self) -> Result<Grad<'a>> {
        match self {
            Gradient::Host(g) => Ok(g),
            Gradient::Device(_) => Err(wrong_memory("a device address", "the CPU")),
        }
    }

    /// The device address a device store reads.
    pub(crate) fn device(self) -> Result<DevicePtr> {
        match self {
            Gradient::Device(g) => Ok(g),
            Gradient::Host(_) => Err(wrong_memory("a host gradient", "a device")),
        }
    }
}

/// Gradients in memory the store cannot read.
fn wrong_memory(what: &str, store: &str) -> Error {
    Error::new(ErrorKind::DeviceMismatch, format!("{what} for an accumulator on {store}"))
}

impl<'a> From<Grad<'a>> for Gradient<'a> {
    fn from(g: Grad<'a>) -> Self {
        Gradient::Host(g)
    }
}

impl From<DevicePtr> for Gradient<'_> {
    fn from(g: DevicePtr) -> Self {
        Gradient::Device(g)
    }
}

impl Accumulator {
    /// A gradient matches its tensor (dtype, length) and the accumulator's memory, and shares no
    /// memory with the master. `argument` names it in the error,
    /// and is only formatted when a check fails.
    pub(super) fn check_grad(
        &self,
        index: usize,
        g: Gradient<'_>,
        argument: impl Fn() -> String,
    ) -> Result<()> {
        let d = self.plan.descs[index];
        let address = match g {
            Gradient::Host(g) => g.addresses().start,
            Gradient::Device(p) => p as usize,
        };
        self.check_form(index, g, &d, &argument)?;
        self.check_overlap(address, &d, argument)
    }

    /// A gradient that overlaps the master would be read while the pass writes it: the result
    /// would depend on the pass's direction and threads (and on the CPU the pass would hold a
    /// shared and a mutable view of the same memory). Any overlap is refused, its own tensor's
    /// master included: the pass reads gradients and writes the master, never the same bytes.
    fn check_overlap(
        &self,
        address: usize,
        d: &TensorDesc,
        argument: impl Fn() -> String,
    ) -> Result<()> {
        let held = self.plan.held();
        let master = self.store.master_address(held.start) as usize;
        let (end, master_end) =
            (address.saturating_add(d.numel * d.dtype.size()), master + held.len() * 4);
        if held.is_empty() || d.numel == 0 || address >= master_end || end <= master {
            return Ok(());
        }
        Err(Error::invalid(format!(
            "{} (bytes {address:#x}..{end:#x}) overlaps the accumulator's master (bytes {master:#x}..{master_end:#x}): a gradient \
             must not share memory with the master (copy it first)",
            argument()
        )))
    }

    /// A gradient's dtype, length and memory kind match its tensor and the accumulator.
    fn check_form(
        &self,
        index: usize,
        g: Gradient<'_>,
        d: &TensorDesc,
        argument: &impl Fn() -> String,
    ) -> Result<()> {
        match (g, self.device()) {
            (Gradient::Host(g), Device::Cpu) => {
                if g.dtype() != d.dtype {
                    return Err(Error::new(
                        ErrorKind::DtypeMismatch,
                        format!(
                            "{} is {}, tensor {index} was declared {}",
                            argument(),
                            g.dtype().name(),
                            d.dtype.name()
                        ),
                    ));
                }
                if g.len() != d.numel {
                    return Err(Error::new(
                        ErrorKind::SizeMismatch,
                        format!(
                            "{} has {} elements, tensor {index} has {}",
                            argument(),
                            g.len(),
                            d.numel
                        ),
                    ));
                }
                Ok(())
            }
            (Gradient::Device(p), Device::Cuda { .. }) => {
                dtype::check_buffer(p as *const c_void, d.numel, d.dtype, &argument())
            }
            (Gradient::Host(_), device) => Err(Error::new(
                ErrorKind::DeviceMismatch,
                format!("{} is host memory, the accumulator is on {}", argument(), device.name()),
            )),
            (Gradient::Device(_), _) => Err(Error::new(
                ErrorKind::DeviceMismatch,
                format!("{} is a device address, the accumulator is on the CPU", argument()),
            )),
        }
    }
}
