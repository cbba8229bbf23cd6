# Shared by the variant generators (variants_r4.py, variants_r6.py): the shipped kernel's text and
# the pieces they take from it, and the guarded statement blocks they write.
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = open(os.path.join(HERE, "..", "..", "..", "..", "kernels", "matvec.wgsl")).read()

# The decode that rounds 4 to 11 ran with (the shipped one until round 12): per f16 pair, a shift
# of the word, two masks and a shift of the sign; `mx_step` as shipped then, on top of it.
PAIR16 = """fn f16_pair(t: u32) -> vec2<f32> {
    return unpack2x16float((t & 0x0e000e00u) | ((t & 0x10001000u) << 3u));
}
fn mx_step(acc: vec4<f32>, word: u32, s14: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let l02 = f16_pair(word << 9u);
    let l13 = f16_pair(word << 1u);
    let h02 = f16_pair(word << 5u);
    let h13 = f16_pair(word >> 3u);
    let lo = vec4<f32>(l02.x, l13.x, l02.y, l13.y) * s14;
    let hi = vec4<f32>(h02.x, h13.x, h02.y, h13.y) * s14;
    return fma(hi, xhi, fma(lo, xlo, acc));
}
"""


def shipped_fn(src, name):
    """The text of WGSL function `name` in `src` (up to its closing brace at column 0)."""
    start = src.index("fn " + name + "(")
    return src[start:src.index("\n}\n", start) + 3]


def guarded(cond, n, stmt, indent):
    """`if (cond) { stmt for k in 0..n }` at `indent` (stmt formats `{k}`)."""
    body = "".join(f"{indent}    {stmt.format(k=k)}\n" for k in range(n))
    return f"{indent}if ({cond}) {{\n{body}{indent}}}\n"
