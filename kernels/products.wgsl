// Shared by matmul.wgsl and matvec.wgsl (prepended to each): the product kernels' parameters, the
// bindings both use (each file declares its own weights at binding 0, u32 words or vec4<u32>, its
// own input `x` at binding 2, f32 or vec4<f32>, and its parameters at binding 4: one `Params` in
// matmul.wgsl, a list of jobs in matvec.wgsl), the MXFP4 decoders (f16 bits; the E2M1 table in
// workgroup memory, which bench variants still use) and the bf16 decoder.

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

// Two E2M1 codes as f32 times 2^-14, from bytes 1 and 3 of `t` already in f16 place (sign at
// bit 7 of the byte, magnitude at bits 3..1); the mask clears every other bit.
fn f16_at(t: u32) -> vec2<f32> {
    return unpack2x16float(t & 0x8e008e00u);
}

// The word's low nibbles (`lows`) and high nibbles (`highs`), each moved into f16 place in its own
// byte by one shift and a bitwise select: bytes 1 and 3 are then an f16 pair under the mask, and
// bytes 0 and 2 one byte-shift away. 11 integer operations per word (the per-pair shifts and masks
// took 16; 3% faster on the H200, bench/data/gpu-variants/matvec/README.md, round 12).
fn nibbles_f16(word: u32) -> vec2<u32> {
    let lows = ((word << 4u) & 0x80808080u) | ((word << 1u) & 0x7f7f7f7fu);
    let highs = (word & 0x80808080u) | ((word >> 3u) & 0x7f7f7f7fu);
    return vec2<u32>(lows, highs);
}

// The E2M1 values of lanes 4g..4g+3 of one block times its scale 2^(E - 127), exactly the CPU's:
// `lo` from the word's low nibbles (the lanes' first elements), `hi` from the high ones. Built as
// f16 bits (the value times 2^-14) and multiplied by 2^(E - 113); a scale byte above 240, whose
// 2^(E - 113) would overflow, takes the values times 2^14 first (exact), then the scale.
struct Mx8 {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

fn mx_values(word: u32, e: u32) -> Mx8 {
    let n = nibbles_f16(word);
    var l02 = f16_at(n.x << 8u);
    var l13 = f16_at(n.x);
    var h02 = f16_at(n.y << 8u);
    var h13 = f16_at(n.y);
    var s = bitcast<f32>((e + 14u) << 23u);
    if (e > 240u) {
        l02 = l02 * 16384.0;
        l13 = l13 * 16384.0;
        h02 = h02 * 16384.0;
        h13 = h13 * 16384.0;
        s = e8m0(e);
    }
    return Mx8(vec4<f32>(l02.x, l13.x, l02.y, l13.y) * s, vec4<f32>(h02.x, h13.x, h02.y, h13.y) * s);
}
