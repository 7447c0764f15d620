"""Run-level skills (NeMo Gym's `skills.path`): a directory of Agent Skills made available to the
agent, and the `skills_ref` every flat row of the run is stamped with.

The directory holds one sub-directory per skill, each with a `SKILL.md` whose YAML front matter
names the skill (`name`, optional `description`, optional `metadata.version`). The `skills_ref`
is `{"path", "hash", "skills": [{name, description, version}]}`: the path as given, and the first
12 hex digits of a SHA-256 over every file's relative path and bytes in sorted order, so a skill
changed in place at the same path is another `skills_ref`. Materialized task rows take no
run-level skills (their task input is the environment's; NeMo Gym refuses the pair).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TypedDict

import yaml

SKILL_FILE = "SKILL.md"
HASH_DIGITS = 12
SKILLS_REFUSED = "run-level skills are not supported for materialized task rows"


class SkillsError(ValueError):
    """Raised when the skills directory cannot be read as a directory of skills."""


def skill_hash(root: Path) -> str:
    """The content hash of a skills directory: relative paths and bytes, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:HASH_DIGITS]


class SkillMetadata(TypedDict):
    """One skill as the `skills_ref` names it."""

    name: str
    description: str | None
    version: str | None


class SkillsRef(TypedDict):
    """The `skills_ref` each row of a run with skills carries: the directory, its hash, its skills."""

    path: str
    hash: str
    skills: list[SkillMetadata]


def skill_metadata(skill_md: Path) -> SkillMetadata:
    """`{name, description, version}` from a `SKILL.md`'s front matter (between `---` lines)."""
    lines = skill_md.read_text(encoding="utf-8-sig", errors="replace").splitlines()
    if not lines or lines[0].strip() != "---":
        raise SkillsError(f"{skill_md} has no YAML front matter (a first line '---')")
    end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), None)
    if end is None:
        raise SkillsError(f"{skill_md} has an unterminated front matter (no closing '---')")
    try:
        data = yaml.safe_load("\n".join(lines[1:end])) or {}
    except yaml.YAMLError as exc:
        raise SkillsError(f"{skill_md} has malformed YAML front matter: {exc}") from None
    if not isinstance(data, dict) or not data.get("name"):
        raise SkillsError(f"{skill_md}'s front matter needs a 'name'")
    metadata = data.get("metadata")
    version = metadata.get("version") if isinstance(metadata, dict) else None
    description = data.get("description")
    return {
        "name": str(data["name"]),
        "description": None if description is None else str(description),
        "version": None if version is None else str(version),
    }


def skills_ref(path: str) -> SkillsRef:
    """The `skills_ref` of the skills directory at `path`; raises SkillsError."""
    root = Path(path).expanduser()
    if not root.exists():
        raise SkillsError(f"the skills path {path} does not exist")
    if not root.is_dir():
        raise SkillsError(f"the skills path {path} is a file, not a directory of skills")
    skills: list[SkillMetadata] = []
    for skill_dir in sorted(d for d in root.iterdir() if d.is_dir()):
        skill_md = skill_dir / SKILL_FILE
        if not skill_md.is_file():
            raise SkillsError(f"the skill directory {skill_dir} has no {SKILL_FILE}")
        skills.append(skill_metadata(skill_md))
    if not skills:
        raise SkillsError(f"the skills path {path} holds no skill (a directory with {SKILL_FILE})")
    return {"path": path, "hash": skill_hash(root), "skills": skills}
