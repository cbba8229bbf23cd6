// Shared by norm.wgsl, route.wgsl, kda.wgsl and mla.wgsl (prepended after detmath.wgsl): the ops'
// parameter block (16 u32 words, read with `pu` / `pf`), the bindings they all use and the 16-lane
// reduction tree. Each file
// declares its second output `out2` at binding 4 (f32 or u32 words) and says what a, b and wq hold.

struct P {
    u: array<vec4<u32>, 4>,
}

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read> wq: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<uniform> p: P;

fn pu(i: u32) -> u32 {
    return p.u[i >> 2u][i & 3u];
}

fn pf(i: u32) -> f32 {
    return bitcast<f32>(pu(i));
}

// The fixed tree over 16 lanes (l, l+8), (l, l+4), (l, l+2), (l, l+1) (`cpu::reduce16`).
fn reduce16(acc: array<f32, 16>) -> f32 {
    var v8: array<f32, 8>;
    for (var t = 0u; t < 8u; t = t + 1u) {
        v8[t] = acc[t] + acc[t + 8u];
    }
    var v4: array<f32, 4>;
    for (var t = 0u; t < 4u; t = t + 1u) {
        v4[t] = v8[t] + v8[t + 4u];
    }
    return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}
