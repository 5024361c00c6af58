//! What an optimizer is built from: the algorithm and its hyperparameters, the learning rate,
//! the rounding into the model's weights, and each tensor's group.

use super::rounding::Rounding;
use crate::error::{Error, Result};

/// The update rule, as PyTorch defines it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Algorithm {
    /// `torch.optim.AdamW` with `amsgrad=False`: decoupled weight decay, bias correction.
    AdamW { beta1: f32, beta2: f32, eps: f32, weight_decay: f32 },
    /// `torch.optim.SGD`: momentum (0 for none), dampening, Nesterov, L2 weight decay.
    Sgd { momentum: f32, dampening: f32, nesterov: bool, weight_decay: f32 },
}

impl Algorithm {
    /// AdamW with PyTorch's defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
    pub fn adamw() -> Self {
        Algorithm::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }

    /// Plain SGD (no momentum, no decay).
    pub fn sgd() -> Self {
        Algorithm::Sgd { momentum: 0.0, dampening: 0.0, nesterov: false, weight_decay: 0.0 }
    }

    /// Whether the algorithm keeps a second state value per element.
    pub(crate) fn second_moment(&self) -> bool {
        matches!(self, Algorithm::AdamW { .. })
    }

    /// Code and hyperparameters, as saved state records them.
    pub(crate) fn encode(&self) -> (u64, [f32; 4]) {
        match *self {
            Algorithm::AdamW { beta1, beta2, eps, weight_decay } => {
                (1, [beta1, beta2, eps, weight_decay])
            }
            Algorithm::Sgd { momentum, dampening, nesterov, weight_decay } => {
                (2 | (nesterov as u64) << 8, [momentum, dampening, 0.0, weight_decay])
            }
        }
    }

    fn validate(&self) -> Result<()> {
        let field = |name: &str, v: f32, ok: bool| {
            if ok && v.is_finite() {
                Ok(())
            } else {
                Err(Error::invalid(format!("`{name}` = {v} is out of range")))
            }
        };
        match *self {
            Algorithm::AdamW { beta1, beta2, eps, weight_decay } => {
                field("beta1", beta1, (0.0..1.0).contains(&beta1))?;
                field("beta2", beta2, (0.0..1.0).contains(&beta2))?;
                field("eps", eps, eps > 0.0)?;
                field("weight_decay", weight_decay, weight_decay >= 0.0)
            }
            Algorithm::Sgd { momentum, dampening, nesterov, weight_decay } => {
                field("momentum", momentum, momentum >= 0.0)?;
                field("dampening", dampening, (0.0..=1.0).contains(&dampening))?;
                field("weight_decay", weight_decay, weight_decay >= 0.0)?;
                if nesterov && (momentum <= 0.0 || dampening != 0.0) {
                    return Err(Error::invalid(format!(
                        "Nesterov momentum needs `momentum` > 0 and `dampening` = 0 (got {momentum} and {dampening})"
                    )));
                }
                Ok(())
            }
        }
    }
}

/// An optimizer's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimizerConfig {
    pub algorithm: Algorithm,
    /// The learning rate of the first step; [`Optimizer::set_lr`](super::Optimizer::set_lr)
    /// changes it for the steps after.
    pub lr: f32,
    pub rounding: Rounding,
}

impl Default for OptimizerConfig {
    /// AdamW with PyTorch's defaults at learning rate 1e-3, rounding to nearest even.
    fn default() -> Self {
        OptimizerConfig { algorithm: Algorithm::adamw(), lr: 1e-3, rounding: Rounding::NearestEven }
    }
}

impl OptimizerConfig {
    pub fn validate(&self) -> Result<()> {
        check_lr(self.lr)?;
        self.algorithm.validate()
    }
}

pub(crate) fn check_lr(lr: f32) -> Result<()> {
    if lr.is_finite() && lr >= 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(format!("`lr` = {lr} is not a finite, non-negative learning rate")))
    }
}

/// One tensor's options: PyTorch's parameter groups, per tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TensorGroup {
    /// Whether the algorithm's weight decay applies (biases and norms commonly take none).
    pub weight_decay: bool,
    /// The tensor's learning rate is the optimizer's times this.
    pub lr_scale: f32,
}

impl Default for TensorGroup {
    fn default() -> Self {
        TensorGroup { weight_decay: true, lr_scale: 1.0 }
    }
}

impl TensorGroup {
    pub(crate) fn validate(&self, index: usize) -> Result<()> {
        if self.lr_scale.is_finite() && self.lr_scale >= 0.0 {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "`groups[{index}].lr_scale` = {} is not finite and non-negative",
                self.lr_scale
            )))
        }
    }
}
