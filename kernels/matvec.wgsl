// One input row (decode) times a weight matrix, in the CPU kernels' operation order (see
// matmul.wgsl for the order and the MXFP4 element layout): out[out_off + row0 + r] = W[r] . x.
//
// Layout of the work: 4 threads per weight row, 16 rows per workgroup of 64. Thread g (0..3) of a
// row owns lanes 4g .. 4g+3 and keeps their 4 accumulators; lane chains never cross threads, so
// each lane's fused multiply-adds run in the CPU's order. Word g of a 16-byte MXFP4 block holds
// exactly lanes 4g..4g+3's low and high nibbles; bf16: words 2g, 2g+1 of a 16-element chunk. The
// inputs are read as vec4<f32> (4 lanes at a time). At the end the 16 lanes go through workgroup
// memory to the fixed tree.
//
// MXFP4 weights come through workgroup memory in tiles of 8 blocks per row: the workgroup copies a
// tile with whole-line vec4 loads (consecutive threads on consecutive 16 bytes) while it computes
// the one before (double buffered), stored transposed ([row][word][block]) so that each thread
// reads its 8 words as two vec4 and neither side has bank conflicts. A thread reading its own
// words straight from memory touches 16 bytes of a line per load; measured on the H200 the tiles
// run 1,390 GB/s against 1,330 for the best such kernel and 990 for the one with the E2M1 table
// (bench/results/2026-12-02-h200-matvec-variants/r*.jsonl). Blocks past the last whole tile,
// and matrices whose weights do not start on 16 bytes or whose rows' scales do not start on a
// word, go straight from memory in the same order.
//
// Decoding: the E2M1 nibbles of a word become f16 bits (magnitude at bits 9..11, sign at 15:
// the f16 value is the E2M1 value times 2^-14, exactly, 0.5 as an f16 subnormal; `nibbles_f16`),
// two per `unpack2x16float`, then times 2^(E - 127 + 14) for the block's E8M0 byte E: exactly the CPU's
// E2M1 value times 2^(E - 127) (a power of two, one rounding at most). Bytes above 240, whose
// 2^(E - 113) would overflow, take the two-step product (E2M1 value, then times 2^(E - 127)).
// On the H200 this ran 1.26x the shared-memory E2M1 table, which costs a shared load per element.
//
// Jobs: one dispatch runs up to MAX_JOBS products of the same row count (`jobs[j]`, each with its
// own weight, scale, input and output offsets in the bindings), `per_job` workgroups each, job after
// job: a group of routed experts' w1 and w3 (or their w2) from one image buffer is one dispatch, so
// their workgroups share the GPU instead of running one small product after another behind a
// barrier. A job's rows are computed exactly as in a dispatch of its own.
//
// Entry points: `matvec` (with the 2-D dispatch fold past 65535 workgroups) and `read_all`, the
// bench's plain-read reference.
//
// bf16 rows are padded to a multiple of 16 elements with zeros at upload (`stride`), and x past
// `cols` is zero in its buffer, so the tail is fma(0, 0, acc) exactly as on the CPU.

// Params, scales, out, lut, e2m1, e8m0 and bf16x4: products.wgsl (prepended).
@group(0) @binding(0) var<storage, read> wv: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
// Job 0's `count` says how many there are; every job has job 0's `rows`.
const MAX_JOBS: u32 = 64u;
@group(0) @binding(4) var<uniform> jobs: array<Params, MAX_JOBS>;

// Rows per workgroup and blocks per tile. A tile row is 9 vec4 apart: 8 of data and one of
// padding, which puts the 32 words a warp writes or reads at once in 32 different banks.
const ROWS: u32 = 16u;
const TILE: u32 = 8u;
const TILE_ROW: u32 = 9u;
const TILE_HALF: u32 = 144u;

var<workgroup> tile: array<vec4<u32>, 288>;
var<workgroup> part: array<vec4<f32>, 64>;

// Word i of the weight binding.
fn word_at(i: u32) -> u32 {
    return wv[i >> 2u][i & 3u];
}

// Lanes 4g..4g+3 of one block: `word`'s low nibbles are their first elements, the high nibbles
// their second (element 16 + 4g + i). `s14` = 2^(E - 113).
fn mx_step(acc: vec4<f32>, word: u32, s14: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let n = nibbles_f16(word);
    let l02 = f16_at(n.x << 8u);
    let l13 = f16_at(n.x);
    let h02 = f16_at(n.y << 8u);
    let h13 = f16_at(n.y);
    let lo = vec4<f32>(l02.x, l13.x, l02.y, l13.y) * s14;
    let hi = vec4<f32>(h02.x, h13.x, h02.y, h13.y) * s14;
    return fma(hi, xhi, fma(lo, xlo, acc));
}

// The same products for any scale byte `e` (`mx_values`: a byte above 240 takes two multiplies).
// Used block by block where the fast path does not apply.
fn mx_step_any(acc: vec4<f32>, word: u32, e: u32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let v = mx_values(word, e);
    return fma(v.hi, xhi, fma(v.lo, xlo, acc));
}

// 2^(E - 113) for byte k of `pk` = four scale bytes plus 14 each.
fn s14_at(pk: u32, k: u32) -> f32 {
    if (k == 3u) {
        return bitcast<f32>((pk >> 1u) & 0x7f800000u);
    }
    return bitcast<f32>((pk << (23u - 8u * k)) & 0x7f800000u);
}

// Whether any byte of `sc` is above 240: its low 7 bits plus 15 carry into bit 7 while bit 7 is set.
fn any_wide(sc: u32) -> bool {
    return (sc & ((sc & 0x7f7f7f7fu) + 0x0f0f0f0fu) & 0x80808080u) != 0u;
}

// Block j of a tile row into the transposed tile: word q to vec4 `at + 2q`, component j & 3.
fn store_tile(at: u32, j: u32, v: vec4<u32>) {
    let c = j & 3u;
    tile[at][c] = v.x;
    tile[at + 2u][c] = v.y;
    tile[at + 4u][c] = v.z;
    tile[at + 6u][c] = v.w;
}

@compute @workgroup_size(64)
fn matvec(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nw: vec3<u32>,
) {
    let flat = wg.y * nw.x + wg.x;
    let per_job = (jobs[0].rows + ROWS - 1u) / ROWS;
    let job = flat / per_job;
    // Workgroups past the last job (the 2-D fold rounds up): uniform per workgroup.
    if (job >= jobs[0].count) {
        return;
    }
    let p = jobs[job];
    let g = lid.x & 3u;
    let slot = lid.x >> 2u;
    let base = (flat - job * per_job) * ROWS;
    let r = base + slot;
    // Rows past the end read row 0 (uniform control flow for the barriers; nothing is written).
    let er = select(0u, r, r < p.rows);
    let x0 = p.x_off / 4u;
    var acc = vec4<f32>(0.0);
    if (p.kind == 1u) {
        let blocks = p.cols >> 5u;
        let row_block = (p.w_off >> 2u) + er * blocks;
        var b = 0u;
        if ((p.w_off & 3u) == 0u && (blocks & 3u) == 0u) {
            let tiles = blocks / TILE;
            // This thread copies block j of tile rows lr and lr + 8.
            let j = lid.x & 7u;
            let lr = lid.x >> 3u;
            let ga = base + lr;
            let gb = ga + 8u;
            let src_a = (p.w_off >> 2u) + select(0u, ga, ga < p.rows) * blocks + j;
            let src_b = (p.w_off >> 2u) + select(0u, gb, gb < p.rows) * blocks + j;
            let dst_a = lr * TILE_ROW + (j >> 2u);
            let dst_b = dst_a + 8u * TILE_ROW;
            let sw0 = p.s_off + ((er * blocks) >> 2u);
            if (tiles > 0u) {
                store_tile(dst_a, j, wv[src_a]);
                store_tile(dst_b, j, wv[src_b]);
            }
            workgroupBarrier();
            for (var t = 0u; t < tiles; t = t + 1u) {
                let cur = (t & 1u) * TILE_HALF;
                let nxt = TILE_HALF - cur;
                // The next tile's loads are in flight while this one computes.
                var va = vec4<u32>(0u);
                var vb = vec4<u32>(0u);
                if (t + 1u < tiles) {
                    va = wv[src_a + (t + 1u) * TILE];
                    vb = wv[src_b + (t + 1u) * TILE];
                }
                let sa = scales[sw0 + t * 2u];
                let sb = scales[sw0 + t * 2u + 1u];
                let row = cur + slot * TILE_ROW + g * 2u;
                let qa = tile[row];
                let qb = tile[row + 1u];
                let xi = x0 + t * 64u + g;
                if (any_wide(sa | sb)) {
                    acc = mx_step_any(acc, qa.x, sa & 0xffu, x[xi], x[xi + 4u]);
                    acc = mx_step_any(acc, qa.y, (sa >> 8u) & 0xffu, x[xi + 8u], x[xi + 12u]);
                    acc = mx_step_any(acc, qa.z, (sa >> 16u) & 0xffu, x[xi + 16u], x[xi + 20u]);
                    acc = mx_step_any(acc, qa.w, sa >> 24u, x[xi + 24u], x[xi + 28u]);
                    acc = mx_step_any(acc, qb.x, sb & 0xffu, x[xi + 32u], x[xi + 36u]);
                    acc = mx_step_any(acc, qb.y, (sb >> 8u) & 0xffu, x[xi + 40u], x[xi + 44u]);
                    acc = mx_step_any(acc, qb.z, (sb >> 16u) & 0xffu, x[xi + 48u], x[xi + 52u]);
                    acc = mx_step_any(acc, qb.w, sb >> 24u, x[xi + 56u], x[xi + 60u]);
                } else {
                    let pa = sa + 0x0e0e0e0eu;
                    let pb = sb + 0x0e0e0e0eu;
                    acc = mx_step(acc, qa.x, s14_at(pa, 0u), x[xi], x[xi + 4u]);
                    acc = mx_step(acc, qa.y, s14_at(pa, 1u), x[xi + 8u], x[xi + 12u]);
                    acc = mx_step(acc, qa.z, s14_at(pa, 2u), x[xi + 16u], x[xi + 20u]);
                    acc = mx_step(acc, qa.w, s14_at(pa, 3u), x[xi + 24u], x[xi + 28u]);
                    acc = mx_step(acc, qb.x, s14_at(pb, 0u), x[xi + 32u], x[xi + 36u]);
                    acc = mx_step(acc, qb.y, s14_at(pb, 1u), x[xi + 40u], x[xi + 44u]);
                    acc = mx_step(acc, qb.z, s14_at(pb, 2u), x[xi + 48u], x[xi + 52u]);
                    acc = mx_step(acc, qb.w, s14_at(pb, 3u), x[xi + 56u], x[xi + 60u]);
                }
                if (t + 1u < tiles) {
                    store_tile(nxt + dst_a, j, va);
                    store_tile(nxt + dst_b, j, vb);
                }
                workgroupBarrier();
            }
            b = tiles * TILE;
        }
        // The blocks past the last tile (or every block), each word straight from memory.
        let sb0 = er * blocks;
        for (; b < blocks; b = b + 1u) {
            let xi = x0 + b * 8u + g;
            let i = p.s_off * 4u + sb0 + b;
            let e = (scales[i >> 2u] >> ((i & 3u) * 8u)) & 0xffu;
            acc = mx_step_any(acc, wv[row_block + b][g], e, x[xi], x[xi + 4u]);
        }
    } else if (r < p.rows) {
        let chunks = p.stride >> 4u;
        // Words 2g, 2g+1 of chunk c of row r: 8 words per chunk.
        let wb = p.w_off + r * (p.stride >> 1u) + 2u * g;
        var c = 0u;
        for (; c + 4u <= chunks; c = c + 4u) {
            let o = wb + c * 8u;
            let a0 = word_at(o);
            let b0 = word_at(o + 1u);
            let a1 = word_at(o + 8u);
            let b1 = word_at(o + 9u);
            let a2 = word_at(o + 16u);
            let b2 = word_at(o + 17u);
            let a3 = word_at(o + 24u);
            let b3 = word_at(o + 25u);
            let xi = x0 + c * 4u + g;
            acc = fma(bf16x4(a0, b0), x[xi], acc);
            acc = fma(bf16x4(a1, b1), x[xi + 4u], acc);
            acc = fma(bf16x4(a2, b2), x[xi + 8u], acc);
            acc = fma(bf16x4(a3, b3), x[xi + 12u], acc);
        }
        for (; c < chunks; c = c + 1u) {
            let o = wb + c * 8u;
            acc = fma(bf16x4(word_at(o), word_at(o + 1u)), x[x0 + c * 4u + g], acc);
        }
    }
    part[lid.x] = acc;
    workgroupBarrier();
    if (g == 0u && r < p.rows) {
        // part[4 slot + j] holds lanes 4j .. 4j+3: the tree (l, l+8), (l, l+4), (l, l+2), (l, l+1).
        let b = slot * 4u;
        let v8a = part[b] + part[b + 2u];
        let v8b = part[b + 1u] + part[b + 3u];
        let v4 = v8a + v8b;
        out[p.out_off + p.row0 + r] = (v4.x + v4.z) + (v4.y + v4.w);
    }
}

// Plain read of the same bytes (what the matvec is compared with in `bench kernels`): the
// weights' access width (one vec4<u32> per thread per load, 4 loads in flight), consecutive
// threads on consecutive 16 bytes, each thread over many of them, one partial written per thread.
@compute @workgroup_size(256)
fn read_all(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let threads = nw.x * 256u;
    let n = arrayLength(&wv);
    var s0 = vec4<u32>(0u);
    var s1 = vec4<u32>(0u);
    var s2 = vec4<u32>(0u);
    var s3 = vec4<u32>(0u);
    var k = gid.x;
    for (; k + 3u * threads < n; k = k + 4u * threads) {
        s0 = s0 ^ wv[k];
        s1 = s1 ^ wv[k + threads];
        s2 = s2 ^ wv[k + 2u * threads];
        s3 = s3 ^ wv[k + 3u * threads];
    }
    for (; k < n; k = k + threads) {
        s0 = s0 ^ wv[k];
    }
    let s = s0 ^ s1 ^ s2 ^ s3;
    out[gid.x] = bitcast<f32>((s.x ^ s.y ^ s.z ^ s.w) & 0x3fffffffu);
}
