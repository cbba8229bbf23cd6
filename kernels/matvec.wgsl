// One input row (decode) times a weight matrix, in the CPU kernels' operation order (see
// matmul.wgsl for the order and the MXFP4 element layout): out[out_off + row0 + r] = W[r] . x.
//
// Layout of the work: 4 threads per weight row, 16 rows per workgroup of 64. Thread g (0..3) of a
// row owns lanes 4g .. 4g+3 and keeps their 4 accumulators; lane chains never cross threads, so
// each lane's fused multiply-adds run in the CPU's order. Per step the 4 threads of a row read 16
// adjacent bytes as one u32 each (MXFP4: word g of a 32-element block holds exactly lanes 4g..4g+3's
// low and high nibbles; bf16: words 2g, 2g+1 of a 16-element chunk), several steps unrolled so
// several loads are in flight. The inputs are read as vec4<f32> (4 lanes at a time). At the end
// the 16 lanes go through workgroup memory to the fixed tree.
//
// Entry points: `matvec` (`MatvecKernel::Wide`, the default) and `matvec_rows` (the candidate
// variants: the same layout and the same float operations per output, specialised per pipeline by
// override constants; see there), both with the 2-D dispatch fold past 65535 workgroups; `read_all`
// is the bench's plain-read reference.
//
// bf16 rows are padded to a multiple of 16 elements with zeros at upload (`stride`), and x past
// `cols` is zero in its buffer, so the tail is fma(0, 0, acc) exactly as on the CPU.

// Params, w, scales, out, p, lut, e2m1, e8m0, scale_at and bf16x4: products.wgsl (prepended).
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

var<workgroup> part: array<vec4<f32>, 64>;

// Lanes 4g+i of one MXFP4 block: byte i of `word` (element 4g+i low nibble, 16+4g+i high nibble).
fn mx_step(acc: vec4<f32>, word: u32, s: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let lo = vec4<f32>(
        lut[word & 15u] * s,
        lut[(word >> 8u) & 15u] * s,
        lut[(word >> 16u) & 15u] * s,
        lut[(word >> 24u) & 15u] * s,
    );
    let hi = vec4<f32>(
        lut[(word >> 4u) & 15u] * s,
        lut[(word >> 12u) & 15u] * s,
        lut[(word >> 20u) & 15u] * s,
        lut[word >> 28u] * s,
    );
    return fma(hi, xhi, fma(lo, xlo, acc));
}

@compute @workgroup_size(64)
fn matvec(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nw: vec3<u32>,
) {
    if (lid.x < 16u) {
        lut[lid.x] = e2m1(lid.x);
    }
    workgroupBarrier();
    let g = lid.x & 3u;
    let slot = lid.x >> 2u;
    let r = (wg.y * nw.x + wg.x) * 16u + slot;
    let x0 = p.x_off / 4u;
    var acc = vec4<f32>(0.0);
    if (r < p.rows) {
        if (p.kind == 1u) {
            let blocks = p.cols >> 5u;
            // Word g of block b of row r: 4 words per block.
            let wb = p.w_off + r * (p.cols >> 3u) + g;
            let sb = r * blocks;
            var b = 0u;
            if ((sb & 3u) == 0u) {
                // The row's scales start on a word (every K3 width is a multiple of 128): the four
                // blocks of a step take their four scales from one load.
                let sw0 = p.s_off + (sb >> 2u);
                for (; b + 4u <= blocks; b = b + 4u) {
                    let w0 = w[wb + b * 4u];
                    let w1 = w[wb + b * 4u + 4u];
                    let w2 = w[wb + b * 4u + 8u];
                    let w3 = w[wb + b * 4u + 12u];
                    let sw = scales[sw0 + (b >> 2u)];
                    let xi = x0 + b * 8u + g;
                    acc = mx_step(acc, w0, e8m0(sw & 0xffu), x[xi], x[xi + 4u]);
                    acc = mx_step(acc, w1, e8m0((sw >> 8u) & 0xffu), x[xi + 8u], x[xi + 12u]);
                    acc = mx_step(acc, w2, e8m0((sw >> 16u) & 0xffu), x[xi + 16u], x[xi + 20u]);
                    acc = mx_step(acc, w3, e8m0(sw >> 24u), x[xi + 24u], x[xi + 28u]);
                }
            } else {
                for (; b + 4u <= blocks; b = b + 4u) {
                    let w0 = w[wb + b * 4u];
                    let w1 = w[wb + b * 4u + 4u];
                    let w2 = w[wb + b * 4u + 8u];
                    let w3 = w[wb + b * 4u + 12u];
                    let xi = x0 + b * 8u + g;
                    acc = mx_step(acc, w0, scale_at(sb + b), x[xi], x[xi + 4u]);
                    acc = mx_step(acc, w1, scale_at(sb + b + 1u), x[xi + 8u], x[xi + 12u]);
                    acc = mx_step(acc, w2, scale_at(sb + b + 2u), x[xi + 16u], x[xi + 20u]);
                    acc = mx_step(acc, w3, scale_at(sb + b + 3u), x[xi + 24u], x[xi + 28u]);
                }
            }
            for (; b < blocks; b = b + 1u) {
                let xi = x0 + b * 8u + g;
                acc = mx_step(acc, w[wb + b * 4u], scale_at(sb + b), x[xi], x[xi + 4u]);
            }
        } else {
            let chunks = p.stride >> 4u;
            // Words 2g, 2g+1 of chunk c of row r: 8 words per chunk.
            let wb = p.w_off + r * (p.stride >> 1u) + 2u * g;
            var c = 0u;
            for (; c + 4u <= chunks; c = c + 4u) {
                let o = wb + c * 8u;
                let a0 = w[o];
                let b0 = w[o + 1u];
                let a1 = w[o + 8u];
                let b1 = w[o + 9u];
                let a2 = w[o + 16u];
                let b2 = w[o + 17u];
                let a3 = w[o + 24u];
                let b3 = w[o + 25u];
                let xi = x0 + c * 4u + g;
                acc = fma(bf16x4(a0, b0), x[xi], acc);
                acc = fma(bf16x4(a1, b1), x[xi + 4u], acc);
                acc = fma(bf16x4(a2, b2), x[xi + 8u], acc);
                acc = fma(bf16x4(a3, b3), x[xi + 12u], acc);
            }
            for (; c < chunks; c = c + 1u) {
                let o = wb + c * 8u;
                acc = fma(bf16x4(w[o], w[o + 1u]), x[x0 + c * 4u + g], acc);
            }
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

// The candidate variants (`MatvecKernel` other than `Wide`, timed side by side by `bench kernels`):
// one entry point, specialised per pipeline by the override constants below. The layout is Wide's
// (thread g of a row owns lanes 4g..4g+3 for the whole row; same loads of the same words, same
// float operations per lane in the same order, same tree), with four knobs:
// - ROWS: weight rows per thread (1, 2 or 4). A thread of slot s takes rows base + 16j + s, so each
//   input vec4 it loads serves ROWS rows (Wide loads it once per row); 16 ROWS rows per workgroup.
// - STEP: blocks (MXFP4) or chunks (bf16) per loop step, all of a step's weight words loaded before
//   any is used: ROWS x STEP (bf16: twice that) loads in flight per thread.
// - PREFETCH: the next step's words (and scales) are loaded before the current step is computed
//   (twice the words held, the memory latency overlapped with a step's arithmetic).
// - ARITH: E2M1 values built from the code's bits in registers (`e2m1`, exact, the same f32 as the
//   table) instead of the shared-memory table, trading a shared load for ~8 integer operations.
// Rows past `rows` read row rows - 1 (in bounds, uniform control flow for the barriers) and are not
// written.
override ROWS: u32 = 1u;
override STEP: u32 = 4u;
override ARITH: bool = false;
override PREFETCH: bool = false;

// ROWS x STEP (bf16: 2 ROWS x STEP) at most.
const MAX_WORDS: u32 = 64u;
var<workgroup> part_rows: array<vec4<f32>, 256>;

fn e2v(code: u32) -> f32 {
    if (ARITH) {
        // Magnitude bits (m3 << 22) + 126 << 23 for codes 2..7 (exponent e + 126, mantissa m);
        // code 1 is 0.5, code 0 is 0; bit 3 the sign.
        let m3 = code & 7u;
        let mag = select(0u, (m3 << 22u) + select(0x3ec00000u, 0x3f000000u, m3 >= 2u), m3 != 0u);
        return bitcast<f32>(mag | ((code & 8u) << 28u));
    }
    return lut[code];
}

// `mx_step` with the decoder chosen by ARITH (the same values, the same products and fmas).
fn mx_step_v(acc: vec4<f32>, word: u32, s: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let lo = vec4<f32>(
        e2v(word & 15u) * s,
        e2v((word >> 8u) & 15u) * s,
        e2v((word >> 16u) & 15u) * s,
        e2v((word >> 24u) & 15u) * s,
    );
    let hi = vec4<f32>(
        e2v((word >> 4u) & 15u) * s,
        e2v((word >> 12u) & 15u) * s,
        e2v((word >> 20u) & 15u) * s,
        e2v(word >> 28u) * s,
    );
    return fma(hi, xhi, fma(lo, xlo, acc));
}

// Step `b`'s MXFP4 words of each row (into `dst[j STEP + t]`) and, rows' scales starting on a word,
// its scale words (`sdst[j STEP / 4 + u]`).
fn load_mx(dst: ptr<function, array<u32, MAX_WORDS>>, sdst: ptr<function, array<u32, 16>>, wb: array<u32, 4>, sb: array<u32, 4>, b: u32) {
    for (var j = 0u; j < ROWS; j = j + 1u) {
        for (var t = 0u; t < STEP; t = t + 1u) {
            (*dst)[j * STEP + t] = w[wb[j] + (b + t) * 4u];
        }
        for (var u = 0u; u < STEP / 4u; u = u + 1u) {
            (*sdst)[j * (STEP / 4u) + u] = scales[p.s_off + ((sb[j] + b) >> 2u) + u];
        }
    }
}

// Step `c`'s bf16 words 2g, 2g+1 of each chunk of each row (into `dst[2 (j STEP + t)] ..`).
fn load_bf(dst: ptr<function, array<u32, MAX_WORDS>>, wb: array<u32, 4>, c: u32) {
    for (var j = 0u; j < ROWS; j = j + 1u) {
        for (var t = 0u; t < STEP; t = t + 1u) {
            let o = wb[j] + (c + t) * 8u;
            (*dst)[(j * STEP + t) * 2u] = w[o];
            (*dst)[(j * STEP + t) * 2u + 1u] = w[o + 1u];
        }
    }
}

@compute @workgroup_size(64)
fn matvec_rows(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nw: vec3<u32>,
) {
    if (lid.x < 16u) {
        lut[lid.x] = e2m1(lid.x);
    }
    workgroupBarrier();
    let g = lid.x & 3u;
    let slot = lid.x >> 2u;
    let base = (wg.y * nw.x + wg.x) * 16u * ROWS;
    let x0 = p.x_off / 4u;
    var rr: array<u32, 4>;
    for (var j = 0u; j < ROWS; j = j + 1u) {
        rr[j] = min(base + 16u * j + slot, p.rows - 1u);
    }
    var acc: array<vec4<f32>, 4>;
    for (var j = 0u; j < ROWS; j = j + 1u) {
        acc[j] = vec4<f32>(0.0);
    }
    var wv: array<u32, MAX_WORDS>;
    if (p.kind == 1u) {
        let blocks = p.cols >> 5u;
        var wb: array<u32, 4>;
        var sb: array<u32, 4>;
        for (var j = 0u; j < ROWS; j = j + 1u) {
            wb[j] = p.w_off + rr[j] * (p.cols >> 3u) + g;
            sb[j] = rr[j] * blocks;
        }
        var b = 0u;
        if ((blocks & 3u) == 0u && STEP % 4u == 0u) {
            // Every row's scales start on a word when a row has a multiple of 4 blocks (every K3
            // width): each 4 blocks of a step take their scales from one load, issued with the
            // step's weight words (before any is used).
            var sw: array<u32, 16>;
            if (PREFETCH && STEP <= blocks) {
                load_mx(&wv, &sw, wb, sb, 0u);
            }
            for (; b + STEP <= blocks; b = b + STEP) {
                var cw = wv;
                var cs = sw;
                if (PREFETCH) {
                    if (b + 2u * STEP <= blocks) {
                        load_mx(&wv, &sw, wb, sb, b + STEP);
                    }
                } else {
                    load_mx(&cw, &cs, wb, sb, b);
                }
                for (var t = 0u; t < STEP; t = t + 1u) {
                    let xi = x0 + (b + t) * 8u + g;
                    let xlo = x[xi];
                    let xhi = x[xi + 4u];
                    for (var j = 0u; j < ROWS; j = j + 1u) {
                        let s = e8m0((cs[j * (STEP / 4u) + t / 4u] >> ((t & 3u) * 8u)) & 0xffu);
                        acc[j] = mx_step_v(acc[j], cw[j * STEP + t], s, xlo, xhi);
                    }
                }
            }
        } else {
            for (; b + STEP <= blocks; b = b + STEP) {
                for (var j = 0u; j < ROWS; j = j + 1u) {
                    for (var t = 0u; t < STEP; t = t + 1u) {
                        wv[j * STEP + t] = w[wb[j] + (b + t) * 4u];
                    }
                }
                for (var t = 0u; t < STEP; t = t + 1u) {
                    let xi = x0 + (b + t) * 8u + g;
                    let xlo = x[xi];
                    let xhi = x[xi + 4u];
                    for (var j = 0u; j < ROWS; j = j + 1u) {
                        acc[j] = mx_step_v(acc[j], wv[j * STEP + t], scale_at(sb[j] + b + t), xlo, xhi);
                    }
                }
            }
        }
        for (; b < blocks; b = b + 1u) {
            let xi = x0 + b * 8u + g;
            let xlo = x[xi];
            let xhi = x[xi + 4u];
            for (var j = 0u; j < ROWS; j = j + 1u) {
                acc[j] = mx_step_v(acc[j], w[wb[j] + b * 4u], scale_at(sb[j] + b), xlo, xhi);
            }
        }
    } else {
        let chunks = p.stride >> 4u;
        var wb: array<u32, 4>;
        for (var j = 0u; j < ROWS; j = j + 1u) {
            wb[j] = p.w_off + rr[j] * (p.stride >> 1u) + 2u * g;
        }
        var c = 0u;
        if (PREFETCH && STEP <= chunks) {
            load_bf(&wv, wb, 0u);
        }
        for (; c + STEP <= chunks; c = c + STEP) {
            var cw = wv;
            if (PREFETCH) {
                if (c + 2u * STEP <= chunks) {
                    load_bf(&wv, wb, c + STEP);
                }
            } else {
                load_bf(&cw, wb, c);
            }
            for (var t = 0u; t < STEP; t = t + 1u) {
                let xv = x[x0 + (c + t) * 4u + g];
                for (var j = 0u; j < ROWS; j = j + 1u) {
                    let i = (j * STEP + t) * 2u;
                    acc[j] = fma(bf16x4(cw[i], cw[i + 1u]), xv, acc[j]);
                }
            }
        }
        for (; c < chunks; c = c + 1u) {
            let xv = x[x0 + c * 4u + g];
            for (var j = 0u; j < ROWS; j = j + 1u) {
                let o = wb[j] + c * 8u;
                acc[j] = fma(bf16x4(w[o], w[o + 1u]), xv, acc[j]);
            }
        }
    }
    write_rows(lid.x, base, acc);
}

// The 16 lanes of each of a thread's ROWS rows (`acc[j]`: lanes 4g..4g+3 of row base + 16j + slot)
// through workgroup memory to the tree, as in `matvec`. Called by every thread (a barrier).
fn write_rows(l: u32, base: u32, acc: array<vec4<f32>, 4>) {
    for (var j = 0u; j < ROWS; j = j + 1u) {
        part_rows[j * 64u + l] = acc[j];
    }
    workgroupBarrier();
    let slot = l >> 2u;
    if ((l & 3u) == 0u) {
        for (var j = 0u; j < ROWS; j = j + 1u) {
            let r = base + 16u * j + slot;
            if (r < p.rows) {
                // The tree (l, l+8), (l, l+4), (l, l+2), (l, l+1).
                let q = j * 64u + slot * 4u;
                let v8a = part_rows[q] + part_rows[q + 2u];
                let v8b = part_rows[q + 1u] + part_rows[q + 3u];
                let v4 = v8a + v8b;
                out[p.out_off + p.row0 + r] = (v4.x + v4.z) + (v4.y + v4.w);
            }
        }
    }
}

// bf16 only (the `*_x2` variants): `matvec_rows` with each thread's two words of a chunk (2g,
// 2g+1, adjacent) read as one vec2<u32> load, through a second view of binding 0 (an entry point
// uses one of the two). Needs an even `w_off` (bf16 trunk matrices start at word 0). No prefetch.
@group(0) @binding(0) var<storage, read> w2: array<vec2<u32>>;

@compute @workgroup_size(64)
fn matvec_rows_bf16x2(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nw: vec3<u32>,
) {
    let g = lid.x & 3u;
    let slot = lid.x >> 2u;
    let base = (wg.y * nw.x + wg.x) * 16u * ROWS;
    let x0 = p.x_off / 4u;
    let chunks = p.stride >> 4u;
    var wb: array<u32, 4>;
    var acc: array<vec4<f32>, 4>;
    for (var j = 0u; j < ROWS; j = j + 1u) {
        // Words 2g, 2g+1 of chunk c of row r: vec2 (w_off + r stride / 2 + 8c + 2g) / 2.
        wb[j] = (p.w_off >> 1u) + min(base + 16u * j + slot, p.rows - 1u) * (p.stride >> 2u) + g;
        acc[j] = vec4<f32>(0.0);
    }
    var wv: array<vec2<u32>, 32>;
    var c = 0u;
    for (; c + STEP <= chunks; c = c + STEP) {
        for (var j = 0u; j < ROWS; j = j + 1u) {
            for (var t = 0u; t < STEP; t = t + 1u) {
                wv[j * STEP + t] = w2[wb[j] + (c + t) * 4u];
            }
        }
        for (var t = 0u; t < STEP; t = t + 1u) {
            let xv = x[x0 + (c + t) * 4u + g];
            for (var j = 0u; j < ROWS; j = j + 1u) {
                let v = wv[j * STEP + t];
                acc[j] = fma(bf16x4(v.x, v.y), xv, acc[j]);
            }
        }
    }
    for (; c < chunks; c = c + 1u) {
        let xv = x[x0 + c * 4u + g];
        for (var j = 0u; j < ROWS; j = j + 1u) {
            let v = w2[wb[j] + c * 4u];
            acc[j] = fma(bf16x4(v.x, v.y), xv, acc[j]);
        }
    }
    write_rows(lid.x, base, acc);
}

// Plain read of the same bytes (what the matvec is compared with in `bench kernels`): the same
// access width (one u32 per thread per load, 4 loads in flight), consecutive threads on consecutive
// words, each thread over many words, one partial written per thread.
@compute @workgroup_size(256)
fn read_all(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let threads = nw.x * 256u;
    let words = arrayLength(&w);
    var s0 = 0u;
    var s1 = 0u;
    var s2 = 0u;
    var s3 = 0u;
    var k = gid.x;
    for (; k + 3u * threads < words; k = k + 4u * threads) {
        s0 = s0 ^ w[k];
        s1 = s1 ^ w[k + threads];
        s2 = s2 ^ w[k + 2u * threads];
        s3 = s3 ^ w[k + 3u * threads];
    }
    for (; k < words; k = k + threads) {
        s0 = s0 ^ w[k];
    }
    out[gid.x] = bitcast<f32>((s0 ^ s1 ^ s2 ^ s3) & 0x3fffffffu);
}
