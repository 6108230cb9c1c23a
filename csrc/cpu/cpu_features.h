// The one CPU-feature switch of every CPU kernel (attention micro-kernels, RoPE, sinusoidal).
#pragma once

namespace attn_ext::cpu {

// True when the environment variable `name` is set to exactly `value` (the kernels' switches:
// ATTN_EXT_CPU_...=0 / =1).
bool env_is(const char* name, const char* value);

// True when the CPU has AVX2, FMA and F16C and ATTN_EXT_CPU_SIMD=0 is not set (for measuring
// and testing the portable paths). Decided once per process (csrc/cpu/cpu_features.cpp).
bool simd_enabled();

// True when simd_enabled() and the CPU (and OS) have AVX-512F and AVX-512BW, unless
// ATTN_EXT_CPU_AVX512=0 is set: the decode kernel's wider PV product (attention_decode.h).
// Decided once per process.
bool avx512_enabled();

// True when avx512_enabled() and the CPU also has AVX512_BF16 (vdpbf16ps) and AVX-512VL: the
// decode kernel's bf16 scores by pairwise dot products (attention_decode.h, dp_scores).
// Decided once per process; ATTN_EXT_CPU_AVX512=0 turns it off with the rest of AVX-512.
bool avx512bf16_enabled();

// True on an Intel CPU (cpuid's vendor). Intel's AVX-512 server cores run 512-bit FMAs on two
// full-width units, and vdpbf16ps at half that rate in FLOPs (this project's Xeon: 105 against
// 210 GFLOP/s, tools/isa_probe.cpp); AMD's Zen 4 splits a zmm FMA into two 256-bit halves and
// runs vdpbf16ps at twice its fp32 rate. The tiled kernels' bf16 default follows from it
// (mk::bf16dp_tiled_enabled). Decided once per process.
bool intel_cpu();

// True when avx512bf16_enabled() and the CPU has AMX-TILE and AMX-BF16, the OS saves the tile
// state (XCR0 bits 17-18) and Linux granted this process the tile data (arch_prctl
// ARCH_REQ_XCOMP_PERM, asked here once): the tiled kernels' bf16 products on AMX tiles
// (attention_amx.cpp; mk::amx_for). Decided once per process.
bool amx_enabled();

}  // namespace attn_ext::cpu
