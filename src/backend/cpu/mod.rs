//! The CPU device: the host store (the master in host memory and the boundary over a host
//! communicator, whole or sharded), the optimizer's state, and the scaler state behind a lock. Its kernels are the
//! host's SIMD kernels (`crate::simd`), which the host transports use too.

mod master;
mod optimizer;
mod scaler;
mod sharded;
mod store;

pub(crate) use optimizer::HostOptimizer;
pub(crate) use scaler::HostScaler;
pub(crate) use store::HostStore;
