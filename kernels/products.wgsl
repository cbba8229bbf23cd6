// Shared by matmul.wgsl and matvec.wgsl (prepended to each): the product kernels' parameters, the
// bindings both use (each file declares its own weights at binding 0, u32 words or vec4<u32>, its
// own input `x` at binding 2, f32 or vec4<f32>, and its parameters at binding 4: one `Params` in
// matmul.wgsl, a list of jobs in matvec.wgsl), the E2M1 table in workgroup memory, and the MXFP4
// element and scale and the bf16 decoders.

struct Params {
    rows: u32,
    cols: u32,
    n: u32,
    kind: u32,
    // Row of W that row 0 of this dispatch is (a matrix split over several bindings).
    row0: u32,
    out_rows: u32,
    // Word offsets of the matrix's weights and scales in their bindings (several matrices share
    // one buffer in the batched expert path).
    w_off: u32,
    s_off: u32,
    // bf16: elements per stored row (cols rounded up to 16). MXFP4: cols.
    stride: u32,
    // Float offsets of the input in `x` and of the output in `out`.
    x_off: u32,
    out_off: u32,
    // matvec.wgsl: the jobs of the dispatch (read from job 0).
    count: u32,
}

@group(0) @binding(1) var<storage, read> scales: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// E2M1 code -> value in workgroup memory: a lookup costs one shared load where the bit-built
// decode costs about ten integer operations per element; 16 words in 16 banks, so any pattern of
// lookups is conflict-free. Filled by the first 16 threads of a workgroup from `e2m1`.
var<workgroup> lut: array<f32, 16>;

// E2M1 code -> value, built as f32 bits: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for 0..7, bit 3 the
// sign (code 8 is -0).
fn e2m1(code: u32) -> f32 {
    let m = code & 7u;
    let e = m >> 1u;
    var bits = 0u;
    if (m == 1u) {
        bits = 0x3f000000u;
    } else if (m >= 2u) {
        bits = ((e + 126u) << 23u) | ((m & 1u) << 22u);
    }
    return bitcast<f32>(bits | ((code & 8u) << 28u));
}

// E8M0 scale -> 2^(s - 127); 0 is 2^-127 (a subnormal), 255 is NaN.
fn e8m0(s: u32) -> f32 {
    if (s == 0u) {
        return bitcast<f32>(0x00400000u);
    }
    if (s == 255u) {
        return bitcast<f32>(0x7fc00000u);
    }
    return bitcast<f32>(s << 23u);
}

// bf16 elements 2i, 2i+1 of word a and of word b as f32 (little-endian: the low half first).
fn bf16x4(a: u32, b: u32) -> vec4<f32> {
    return vec4<f32>(
        bitcast<f32>(a << 16u),
        bitcast<f32>(a & 0xffff0000u),
        bitcast<f32>(b << 16u),
        bitcast<f32>(b & 0xffff0000u),
    );
}
