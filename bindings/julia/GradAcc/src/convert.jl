# Array conversions between Float32 and the 16-bit formats' bits, through the C library's
# vectorised loops (gradacc_f32_to_f16 and friends): rounding to nearest even on the way down,
# exact on the way up. Julia has Float16 (and BFloat16s.jl, or Core.BFloat16 from 1.11), so these
# are for bits: bf16 words from a C or Python buffer, or the same bits as gradacc's own rounding.

function convert_into!(f, dst::DenseVector, src::DenseVector)
    length(dst) == length(src) || throw(GradAccError(GRADACC_STATUS_SIZE_MISMATCH,
        "dst has $(length(dst)) elements, src $(length(src))"))
    GC.@preserve src dst check(f(pointer(src), pointer(dst), length(src)))
    return dst
end

"""
    GradAcc.f32_to_f16!(dst::DenseVector{UInt16}, src::DenseVector{Float32}) -> dst
    GradAcc.f32_to_f16(src::DenseVector{Float32}) -> Vector{UInt16}

`src` rounded to IEEE binary16 bits, to nearest even (`reinterpret(Float16, bits)` reads them).
`dst` must be as long as `src` (else `GRADACC_STATUS_SIZE_MISMATCH`) and must not overlap it.
"""
f32_to_f16!(dst::DenseVector{UInt16}, src::DenseVector{Float32}) =
    convert_into!(gradacc_f32_to_f16, dst, src)
f32_to_f16(src::DenseVector{Float32}) = f32_to_f16!(Vector{UInt16}(undef, length(src)), src)

"""
    GradAcc.f16_to_f32!(dst::DenseVector{Float32}, src::DenseVector{UInt16}) -> dst
    GradAcc.f16_to_f32(src::DenseVector{UInt16}) -> Vector{Float32}

The Float32 value of each binary16 word of `src`, exactly. Lengths as in `f32_to_f16!`.
"""
f16_to_f32!(dst::DenseVector{Float32}, src::DenseVector{UInt16}) =
    convert_into!(gradacc_f16_to_f32, dst, src)
f16_to_f32(src::DenseVector{UInt16}) = f16_to_f32!(Vector{Float32}(undef, length(src)), src)

"""
    GradAcc.f32_to_bf16!(dst::DenseVector{UInt16}, src::DenseVector{Float32}) -> dst
    GradAcc.f32_to_bf16(src::DenseVector{Float32}) -> Vector{UInt16}

`src` rounded to bfloat16 bits, to nearest even: the words a bf16 gradient holds. Lengths as in
`f32_to_f16!`.
"""
f32_to_bf16!(dst::DenseVector{UInt16}, src::DenseVector{Float32}) =
    convert_into!(gradacc_f32_to_bf16, dst, src)
f32_to_bf16(src::DenseVector{Float32}) = f32_to_bf16!(Vector{UInt16}(undef, length(src)), src)

"""
    GradAcc.bf16_to_f32!(dst::DenseVector{Float32}, src::DenseVector{UInt16}) -> dst
    GradAcc.bf16_to_f32(src::DenseVector{UInt16}) -> Vector{Float32}

The Float32 value of each bfloat16 word of `src`, exactly. Lengths as in `f32_to_f16!`.
"""
bf16_to_f32!(dst::DenseVector{Float32}, src::DenseVector{UInt16}) =
    convert_into!(gradacc_bf16_to_f32, dst, src)
bf16_to_f32(src::DenseVector{UInt16}) = bf16_to_f32!(Vector{Float32}(undef, length(src)), src)
