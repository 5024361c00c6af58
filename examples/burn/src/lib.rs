//! gradacc under a Burn training loop: `adapter` is the part to copy into a project, `train` an
//! example loop built on it (a 2-layer MLP, 2 in-process ranks, half-precision gradients).

pub mod adapter;
pub mod train;
