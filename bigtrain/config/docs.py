"""The schema's attribute docstrings, read from the source, and the config as YAML with them as
comments (`bigtrain config show --docs`).

Python keeps no attribute docstrings at run time: they are read with `ast` from the modules that
define the dataclasses, as the string statement right under each field.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
from dataclasses import fields, is_dataclass
from functools import cache
from typing import Any

import yaml

from bigtrain.config.schema import Config

INDENT = "  "  # as OmegaConf.to_yaml writes, so both outputs look alike


@cache
def _class_node(cls: type) -> ast.ClassDef:
    tree = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)


def class_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring} of a dataclass: each annotated field followed by a string."""
    body = _class_node(cls).body
    docs = {}
    for field_node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(field_node, ast.AnnAssign)
            and isinstance(field_node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[field_node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _section_type(f: Any) -> type | None:
    default = f.default_factory() if callable(f.default_factory) else f.default
    return type(default) if is_dataclass(default) else None


@cache
def field_docs(schema: type = Config, prefix: str = "") -> dict[str, str]:
    """{dotted key: docstring} for every key of the schema, sections included (a section without
    a docstring of its own gets its class docstring)."""
    own = class_docs(schema)
    out: dict[str, str] = {}
    for f in fields(schema):
        key = f"{prefix}{f.name}"
        section = _section_type(f)
        out[key] = own.get(f.name, "")
        if section is not None:
            out[key] = out[key] or ast.get_docstring(_class_node(section)) or ""
            out.update(field_docs(section, key + "."))
    return out


def yaml_with_docs(tree: dict[str, Any]) -> str:
    """`tree` (the config as plain data, `to_dict`) as YAML, each key's docstring as comment lines
    right above it. yaml.safe_load reads it back as `tree`."""
    docs = field_docs()
    sections = {key.rpartition(".")[0] for key in docs}
    return "\n".join(_lines(tree, docs, sections, "", 0)) + "\n"


def _lines(
    tree: dict[str, Any], docs: dict[str, str], sections: set[str], prefix: str, depth: int
) -> list[str]:
    pad = INDENT * depth
    lines = []
    for name, value in tree.items():
        key = f"{prefix}{name}"
        lines += [f"{pad}# {line}".rstrip() for line in docs.get(key, "").splitlines()]
        if key in sections:  # a schema section: its keys follow, each with its docstring
            lines.append(f"{pad}{name}:")
            lines += _lines(value, docs, sections, key + ".", depth + 1)
            continue
        # A leaf, also a free-form dict or list (model.hf_config, data.mixture): as YAML dumps it.
        dumped = yaml.safe_dump({name: value}, default_flow_style=False, sort_keys=False)
        lines += [pad + line for line in dumped.rstrip("\n").splitlines()]
    return lines


def reference_markdown() -> str:
    """docs/config-reference.md: every key of the schema, section by section, with its default
    and docstring. tests/test_docs.py checks that the page equals this (regenerate it with
    `python -m bigtrain.config.docs > docs/config-reference.md`)."""
    from bigtrain.config.load import flatten, to_dict

    docs, defaults = field_docs(), flatten(to_dict(Config()))
    lines = [
        "# Config reference",
        "",
        "Every key, its default and what it does, from the schema's docstrings (also printed by",
        "`bigtrain config show --docs`). Generated: `python -m bigtrain.config.docs >",
        "docs/config-reference.md`.",
    ]
    for section in (f.name for f in fields(Config)):
        lines += ["", f"## {section}", "", docs[section].replace("\n", " "), ""]
        lines += ["| key | default | what it does |", "| --- | --- | --- |"]
        for key, doc in docs.items():
            if key.startswith(section + ".") and key in defaults:
                default = json.dumps(defaults[key]).replace("|", "\\|")
                text = " ".join(doc.split()).replace("|", "\\|")
                lines.append(f"| `{key}` | `{default}` | {text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference_markdown())
