//! Element types of model gradients and the borrowed views the kernels read.
//! 16-bit formats travel as raw `u16` bits: the library never needs a half-float type of its own.

/// Element type of a model gradient buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }

    /// The stable code of the dtype: GRADACC_DTYPE_* in the C API, `GA_DTYPE_*` in the kernels,
    /// and the byte the layout fingerprint holds.
    pub fn code(self) -> i32 {
        match self {
            Dtype::F32 => 0,
            Dtype::F16 => 1,
            Dtype::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }
}

/// A borrowed gradient buffer of one of the supported element types.
#[derive(Clone, Copy, Debug)]
pub enum Grad<'a> {
    F32(&'a [f32]),
    /// IEEE 754 binary16 bit patterns.
    F16(&'a [u16]),
    /// bfloat16 bit patterns (the upper half of an f32).
    Bf16(&'a [u16]),
}

impl<'a> Grad<'a> {
    pub fn len(&self) -> usize {
        match self {
            Grad::F32(s) => s.len(),
            Grad::F16(s) | Grad::Bf16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> Dtype {
        match self {
            Grad::F32(_) => Dtype::F32,
            Grad::F16(_) => Dtype::F16,
            Grad::Bf16(_) => Dtype::Bf16,
        }
    }

    /// The sub-range `[start, end)` of this buffer.
    pub fn slice(&self, start: usize, end: usize) -> Grad<'a> {
        match *self {
            Grad::F32(s) => Grad::F32(&s[start..end]),
            Grad::F16(s) => Grad::F16(&s[start..end]),
            Grad::Bf16(s) => Grad::Bf16(&s[start..end]),
        }
    }
}

/// A mutable buffer of one of the supported element types (a loss to scale in place).
#[derive(Debug)]
pub enum GradMut<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [u16]),
    Bf16(&'a mut [u16]),
}
