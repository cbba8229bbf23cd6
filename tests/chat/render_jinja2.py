"""Renders chat templates the way Hugging Face's `apply_chat_template` does (jinja2 sandbox with
trim_blocks, lstrip_blocks and loop controls; `raise_exception`; `tojson` = json.dumps with
ensure_ascii=False), for comparison with the engine.

    python3 render_jinja2.py TEMPLATE CASES_JSON > RESULTS_JSON

CASES_JSON is a list of template contexts; each result is {"text": ...} or {"error": message}.
"""

import json
import sys

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def main():
    template_path, cases_path = sys.argv[1:3]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    with open(template_path, encoding="utf-8") as f:
        template = env.from_string(f.read())
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    out = []
    for ctx in cases:
        try:
            out.append({"text": template.render(**ctx)})
        except TemplateError as e:
            out.append({"error": str(e)})
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
