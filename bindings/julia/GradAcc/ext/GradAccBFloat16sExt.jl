# bf16 gradients as BFloat16s.jl's BFloat16: the same bits as gradacc's bf16 dtype.
module GradAccBFloat16sExt

using GradAcc: GradAcc, GRADACC_DTYPE_BF16
using BFloat16s: BFloat16s

# From Julia 1.11 BFloat16s.BFloat16 can be Core.BFloat16 itself, which GradAcc already handles;
# defining its methods again would overwrite them, which precompilation refuses.
if !(isdefined(Core, :BFloat16) && BFloat16s.BFloat16 === getfield(Core, :BFloat16))
    GradAcc.dtype_code(::Type{BFloat16s.BFloat16}) = GRADACC_DTYPE_BF16
    GradAcc.isbf16(::Type{BFloat16s.BFloat16}) = true
end

end # module
