"""Reading the volunteer's install files as Docker and systemd read them: a Dockerfile's instructions
(ENTRYPOINT in exec form, COPY, ENV, RUN's pip installs, EXPOSE, VOLUME, USER), which repository
paths .dockerignore lets into the build context, and a systemd unit's [Service] settings; then the
command either one runs, with the paths inside the image or the host rewritten to local ones."""

from __future__ import annotations

import configparser
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO / "peers"
DOCKERFILES = sorted(PEERS.glob("Dockerfile*"))
UNIT = PEERS / "lowcomm-peer.service"


@dataclass
class Dockerfile:
    path: Path
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, its arguments), in order

    @classmethod
    def read(cls, path: Path) -> "Dockerfile":
        lines, pending = [], ""
        for raw in path.read_text().splitlines():
            if not pending and (not raw.strip() or raw.lstrip().startswith("#")):
                continue
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            lines.append(pending + raw)
            pending = ""
        dockerfile = cls(path)
        for line in lines:
            keyword, _, args = line.strip().partition(" ")
            dockerfile.instructions.append((keyword.upper(), " ".join(args.split())))
        return dockerfile

    def args(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    @property
    def entrypoint(self) -> list[str]:
        (text,) = self.args("ENTRYPOINT")[-1:]
        command = json.loads(text)  # the exec form: a JSON array, so that `docker run IMAGE FLAGS` appends
        assert isinstance(command, list) and all(isinstance(word, str) for word in command), text
        return command

    @property
    def copies(self) -> list[tuple[list[str], str]]:
        """(sources in the build context, destination in the image) of every COPY."""
        found = []
        for args in self.args("COPY"):
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            found.append((words[:-1], words[-1]))
        return found

    @property
    def env(self) -> dict[str, str]:
        values = {}
        for args in self.args("ENV"):
            for word in shlex.split(args):
                name, _, value = word.partition("=")
                values[name] = value
        return values

    @property
    def pip_installs(self) -> list[list[str]]:
        """The words of every `pip install` command in a RUN."""
        commands = []
        for args in self.args("RUN"):
            for command in re.split(r"&&|;", args):
                words = shlex.split(command)
                if words[:2] == ["pip", "install"]:
                    commands.append(words)
        return commands

    @property
    def exposed(self) -> set[int]:
        return {int(word.split("/")[0]) for args in self.args("EXPOSE") for word in args.split()}

    @property
    def volumes(self) -> list[str]:
        found = []
        for args in self.args("VOLUME"):
            found += json.loads(args) if args.startswith("[") else args.split()
        return found

    @property
    def user(self) -> str | None:
        return (self.args("USER") or [None])[-1]

    def profile_source(self, profile: str) -> Path:
        """The repository file that a COPY puts at `profile` in the image."""
        for sources, destination in self.copies:
            if destination == profile:
                (source,) = sources
                return REPO / source
        raise AssertionError(f"{self.path.name}: no COPY puts a file at {profile}")


# ---- the build context -----------------------------------------------------------------------

def _pattern(text: str) -> re.Pattern:
    """A .dockerignore pattern as a regex over a /-separated path (`**`: any number of folders)."""
    pieces = text.strip().strip("/").split("/")
    regex = ""
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        if piece == "**":
            regex += ".*" if last else "(?:[^/]+/)*"
        else:
            regex += re.escape(piece).replace(r"\*", "[^/]*").replace(r"\?", "[^/]") + ("" if last else "/")
    return re.compile(f"^{regex}$")


def in_build_context(relative: str, dockerignore: Path = REPO / ".dockerignore") -> bool:
    """Whether `relative` (a path under the repository root) is sent to the Docker engine: the last
    .dockerignore pattern that matches it or one of its parent folders decides; `!` lets it back in."""
    if not dockerignore.exists():
        return True
    rules = []
    for line in dockerignore.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            rules.append((_pattern(line.lstrip("!")), negated))
    parts = Path(relative).parts
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    included = True
    for pattern, negated in rules:
        if any(pattern.match(c) for c in candidates):
            included = negated
    return included


# ---- the systemd unit ------------------------------------------------------------------------

def read_unit(path: Path = UNIT) -> configparser.ConfigParser:
    """The unit's sections as systemd reads them: keys case-sensitive, repeated keys allowed (the last
    one wins here), no interpolation."""
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",),
                                       comment_prefixes=("#", ";"), empty_lines_in_values=False)
    parser.optionxform = str
    parser.read_string(path.read_text())
    return parser


def unit_environment(service: configparser.SectionProxy) -> dict[str, str]:
    """Environment= assignments (one or several, quoted or not, on one line)."""
    values = {}
    for word in shlex.split(service.get("Environment", "")):
        name, _, value = word.partition("=")
        values[name] = value
    return values


# ---- the command, run here -------------------------------------------------------------------

def rewrite(words: list[str], mapping: dict[str, Path]) -> list[str]:
    """Each word that is a mapped path, or lies under one, moved to the local path."""
    out = []
    for word in words:
        for inside, local in sorted(mapping.items(), key=lambda item: -len(item[0])):
            if word == inside or word.startswith(inside.rstrip("/") + "/"):
                word = str(local) + word[len(inside.rstrip("/")):]
                break
        out.append(word)
    return out
