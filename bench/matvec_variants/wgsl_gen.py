# Shared by the variant generators (variants_r4.py, variants_r6.py): the shipped kernel's text and
# the pieces they take from it, and the guarded statement blocks they write.
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = open(os.path.join(HERE, "..", "..", "kernels", "matvec.wgsl")).read()


def shipped_fn(src, name):
    """The text of WGSL function `name` in `src` (up to its closing brace at column 0)."""
    start = src.index("fn " + name + "(")
    return src[start:src.index("\n}\n", start) + 3]


def guarded(cond, n, stmt, indent):
    """`if (cond) { stmt for k in 0..n }` at `indent` (stmt formats `{k}`)."""
    body = "".join(f"{indent}    {stmt.format(k=k)}\n" for k in range(n))
    return f"{indent}if ({cond}) {{\n{body}{indent}}}\n"
