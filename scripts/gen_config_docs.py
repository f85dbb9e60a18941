#!/usr/bin/env python3
"""Write README's configuration table and docs/configuration.md from the settings in
vllm_omni_graphdecode/config.py, the one place each setting's meaning is written.

    python3 scripts/gen_config_docs.py          # rewrite both
    python3 scripts/gen_config_docs.py --check  # exit 1 naming each page that is stale

Stdlib and the package only (config.py imports no model code). The README's table sits between
the two marker comments below; docs/configuration.md is written whole. What a variable accepts is
taken from its parser's own error message, so the page says what start-up says.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vllm_omni_graphdecode import config  # noqa: E402

README = os.path.join(ROOT, "README.md")
CONFIG_DOC = os.path.join(ROOT, "docs", "configuration.md")
BEGIN = ("<!-- configuration table: written by scripts/gen_config_docs.py from "
         "vllm_omni_graphdecode/config.py; edit there -->")
END = "<!-- end of the configuration table -->"
COMMAND = "python3 scripts/gen_config_docs.py"


def anchor(setting: config.Setting) -> str:
    """GitHub's anchor of the setting's heading in docs/configuration.md."""
    return setting.var.lower()


def default_cell(setting: config.Setting) -> str:
    return f"`{setting.default}`" if setting.default else "unset"


def accepted(setting: config.Setting) -> str:
    if setting.accepts:
        return setting.accepts
    try:
        setting.parse(setting.var, "\x00")
    except config.ConfigError as e:
        return str(e).split("; accepted: ", 1)[1]
    raise ValueError(f"{setting.var}: its parser accepts anything; give the Setting `accepts`")


def table() -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for s in config.SETTINGS:
        rows.append(f"| `{s.var}` | {default_cell(s)} | {s.short} "
                    f"([more](docs/configuration.md#{anchor(s)})) |")
    return "\n".join(rows)


def readme(text: str) -> str:
    """``text`` (README.md) with the table between the markers written anew."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"README.md needs the two marker lines once each:\n{BEGIN}\n{END}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def configuration() -> str:
    out = [
        "<!-- Written by scripts/gen_config_docs.py from vllm_omni_graphdecode/config.py: edit "
        "there, then run it. -->",
        "",
        "# Configuration",
        "",
        "Every variable is read once at start-up; a value outside what is accepted stops "
        "start-up with a",
        "message naming the variable, the value and what is accepted. "
        "`python -m vllm_omni_graphdecode",
        "doctor` prints the parsed values. The README's table holds each one's first "
        "paragraph; why each",
        "default is what it is: [performance](performance.md#how-each-default-was-set).",
        "",
        " · ".join(f"[`{s.var}`](#{anchor(s)})" for s in config.SETTINGS),
    ]
    for s in config.SETTINGS:
        out += ["", f"## `{s.var}`", "",
                f"Default: {default_cell(s)}. Accepted: {accepted(s)}.", "", s.short]
        if s.long:
            out += ["", s.long]
    return "\n".join(out) + "\n"


def stale() -> list[str]:
    """The pages whose text differs from what the settings write."""
    out = []
    with open(README) as f:
        text = f.read()
    if text != readme(text):
        out.append("README.md")
    if not os.path.exists(CONFIG_DOC) or open(CONFIG_DOC).read() != configuration():
        out.append("docs/configuration.md")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when stale")
    args = ap.parse_args(argv)
    if args.check:
        pages = stale()
        for page in pages:
            print(f"{page} is stale against vllm_omni_graphdecode/config.py: run {COMMAND}",
                  file=sys.stderr)
        return 1 if pages else 0
    with open(README) as f:
        text = f.read()
    with open(README, "w") as f:
        f.write(readme(text))
    with open(CONFIG_DOC, "w") as f:
        f.write(configuration())
    return 0


if __name__ == "__main__":
    sys.exit(main())
