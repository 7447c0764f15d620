"""mkdocs hook: reference tables rendered from the code at every build, so they cannot drift.

A page asks for one with a line of its own, `<!-- generated: KIND TARGET -->`:

    model MODULE:CLASS         a pydantic model's fields: name (alias), type, default, docstring
    env MODULE:CLASS           a dataclass of `ROLLOUTS_*` variables: variable, default, docstring
    redis-keys MODULE          every key a module names: its pattern and docstring
    enum MODULE:CLASS          an enum's values and their docstrings
    names MODULE:ATTR          a tuple of names, one per line, as a list

Docstrings are the attribute docstrings of the source (the string under each field), read with
`ast`; types are the annotations as written. An unknown kind or target fails the build.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import html
import importlib
import inspect
import json
import re
import textwrap
from typing import Any

_DIRECTIVE = re.compile(r"^<!-- generated: (?P<kind>[a-z-]+) (?P<target>\S+) -->$", re.MULTILINE)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """Replace each directive line of a page with the table it names."""
    return _DIRECTIVE.sub(lambda m: _render(m["kind"], m["target"]), markdown)


def _render(kind: str, target: str) -> str:
    renderers = {
        "model": _model_table,
        "env": _env_table,
        "redis-keys": _redis_keys,
        "enum": _enum_table,
        "names": _names_list,
    }
    if kind not in renderers:
        raise ValueError(f"unknown generated kind {kind!r} (known: {', '.join(renderers)})")
    return renderers[kind](target)


def _resolve(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def _one_line(text: str | None) -> str:
    """A docstring as one table cell: paragraphs joined, pipes kept out of the table's way."""
    if not text:
        return ""
    return _cell(" ".join(inspect.cleandoc(text).split()))


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def _cell(text: str) -> str:
    """Markdown for a table cell: code spans as `<code>` (a `\\|` inside backticks would show its
    backslash), other pipes escaped."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: leave the text as it is
        return text.replace("|", "\\|")
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append("<code>" + html.escape(part).replace("|", "&#124;") + "</code>")
        else:
            out.append(part.replace("|", "\\|"))
    return "".join(out)


def _code(text: str) -> str:
    return _cell(f"`{text}`")


def _attribute_docs(body: list[ast.stmt]) -> dict[str, tuple[str, str]]:
    """name -> (annotation as written, docstring) for each assignment followed by a string."""
    out: dict[str, tuple[str, str]] = {}
    for stmt, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            name, annotation = stmt.target.id, ast.unparse(stmt.annotation)
        elif (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
        ):
            name, annotation = stmt.targets[0].id, ""
        else:
            continue
        doc = ""
        if (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            doc = after.value.value
        out[name] = (annotation, doc)
    return out


def _class_docs(cls: type) -> dict[str, tuple[str, str]]:
    """Attribute docs of `cls` and of its bases defined in this project, nearest class first."""
    out: dict[str, tuple[str, str]] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.split(".")[0] not in ("schemas", "infra", "producer", "workers"):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        node = tree.body[0]
        assert isinstance(node, ast.ClassDef)
        out.update(_attribute_docs(node.body))
    return out


def _default(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        text = json.dumps(value, default=lambda v: v.model_dump(mode="json"))
    except TypeError:
        text = repr(value)
    return f"`{text}`"


def _model_table(target: str) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    cls = _resolve(target)
    if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
        raise TypeError(f"{target} is not a pydantic model")
    docs = _class_docs(cls)
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        annotation, doc = docs.get(name, ("", ""))
        shown = field.alias or name
        choices = field.validation_alias
        names = [shown]
        if choices is not None and hasattr(choices, "choices"):
            names += [c for c in choices.choices if isinstance(c, str) and c != shown]
        label = " ".join(f"`{n}`" for n in names[:1])
        if len(names) > 1:
            label += " (alias " + ", ".join(f"`{n}`" for n in names[1:]) + ")"
        anchor = f'<a id="{shown}"></a>' if cls.__module__ == "schemas.settings" else ""
        if field.default is PydanticUndefined and field.default_factory is None:
            default = "required"
        else:
            default = _default(field.get_default(call_default_factory=True))
        rows.append(
            f"| {anchor}{label} | {_code(annotation or str(field.annotation))} | "
            f"{_cell(default)} | {_one_line(doc)} |"
        )
    return "\n".join(rows) + "\n"


_VARIABLE = re.compile(r"^`(?P<var>[A-Z][A-Z0-9_]*)(?:=[^`]*)?`:?\s*")


def _env_table(target: str) -> str:
    cls = _resolve(target)
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{target} is not a dataclass")
    docs = _class_docs(cls)  # type: ignore[arg-type]
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        doc = inspect.cleandoc(docs.get(f.name, ("", ""))[1])
        m = _VARIABLE.match(doc)
        if m is None:
            raise ValueError(f"{target}.{f.name}: its docstring does not start with `VARIABLE`")
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = "unset" if default is None else _default(default)
        rows.append(
            f'| <a id="{m["var"]}"></a>`{m["var"]}` | {_cell(shown)} | '
            f"{_capitalized(_one_line(doc[m.end() :]))} |"
        )
    return "\n".join(rows) + "\n"


def _redis_keys(target: str) -> str:
    module = _resolve(target)
    tree = ast.parse(inspect.getsource(module))
    attrs = _attribute_docs(tree.body)
    rows = ["| key | name in the code | what it holds |", "|---|---|---|"]
    placeholders = {
        "sid": "<sid>",
        "token": "<token>",
        "rollout": "<rollout>",
        "agent_url": "<agent>",
        "invocation": "<call>",
        "tag": "<tag>",
        "name": "<feed>",
        "group": "<group>",
    }
    for node in tree.body:
        name = doc = None
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            if node.name.endswith("_prefix"):  # a part of a key, not a key
                continue
            fn = getattr(module, node.name)
            params = list(inspect.signature(fn).parameters)
            if not params or any(p not in placeholders for p in params):
                continue
            key = fn(*(placeholders[p] for p in params))
            name, doc = f"{node.name}({', '.join(params)})", ast.get_docstring(node) or ""
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            attr = node.targets[0].id
            value = getattr(module, attr, None)
            if callable(value) and attr.startswith("shard_"):
                key, name, doc = value("<sid>"), f"{attr}(sid)", attrs[attr][1]
            elif callable(value) and attr.startswith("feed_"):
                key, name, doc = value("<feed>"), f"{attr}(name)", attrs[attr][1]
            elif (
                isinstance(value, str)
                and value.startswith(f"{module.PREFIX}:")
                and "%s" not in value
            ):
                key, name, doc = value, attr, attrs[attr][1]
            else:
                continue
        else:
            continue
        if not isinstance(key, str):
            continue
        key = _AGENT_DIGEST.sub(":<agent-hash>:", key)
        rows.append(f"| {_code(key)} | `{name}` | {_one_line(doc)} |")
    return "\n".join(rows) + "\n"


_AGENT_DIGEST = re.compile(r":[0-9a-f]{20}:")
"""The digest of an agent's URL in its keys, shown as a placeholder."""


def _enum_table(target: str) -> str:
    cls = _resolve(target)
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        raise TypeError(f"{target} is not an enum")
    docs = _class_docs(cls)
    rows = ["| value | meaning |", "|---|---|"]
    for member in cls:
        rows.append(f"| `{member.value}` | {_one_line(docs.get(member.name, ('', ''))[1])} |")
    return "\n".join(rows) + "\n"


def _names_list(target: str) -> str:
    names = _resolve(target)
    if not isinstance(names, tuple | list | frozenset | set):
        raise TypeError(f"{target} is not a collection of names")
    return "\n".join(f"- `{n}`" for n in names) + "\n"
