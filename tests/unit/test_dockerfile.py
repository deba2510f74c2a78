"""The image's Dockerfile, parsed (no Docker daemon here: it is not built in CI): only ARG
before FROM, non-root users and the `dyad` entry point in the targets pods run, a CUDA base, the
package installed with its generated stubs and every folder it is built from, and every COPY
source present in the build context.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from tests.helpers.k8s_manifests import REPO


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, arguments = full.partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def dockerfile_stages(instructions) -> dict[str, dict]:
    """stage name -> {"from": its base, "user": effective USER, "entrypoint": effective}."""
    stages, current = {}, None
    for keyword, arguments in instructions:
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", arguments, re.IGNORECASE)
            image, name = match.group(1), match.group(2) or f"stage{len(stages)}"
            parent = stages.get(image, {})
            current = stages[name] = {"from": image, "user": parent.get("user", "root"),
                                      "entrypoint": parent.get("entrypoint")}
        elif keyword == "USER":
            current["user"] = arguments
        elif keyword == "ENTRYPOINT":
            current["entrypoint"] = json.loads(arguments)
    return stages


def test_dockerfile():
    text = (REPO / "Dockerfile").read_text()
    instructions = dockerfile_instructions(text)
    keywords = [k for k, _ in instructions]
    assert all(k == "ARG" for k in keywords[: keywords.index("FROM")]), "only ARG may precede FROM"
    stages = dockerfile_stages(instructions)
    last = list(stages)[-1]
    for target in (last, "rdma"):
        user = stages[target]["user"].split(":")[0]
        assert user not in ("root", "0"), f"target {target} runs as {user}"
        assert stages[target]["entrypoint"] == ["dyad"], target
    assert stages["base"]["from"].startswith("nvidia/cuda:")
    run = " ".join(a for k, a in instructions if k == "RUN")
    assert "pip install . ucxx-cu12" in run
    assert "grpc_tools.protoc" in run  # the installed package needs its stubs
    # every COPY source exists and is not kept out of the build context by .dockerignore
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for keyword, arguments in instructions:
        if keyword != "COPY" or arguments.startswith("--from"):
            continue
        *sources, _ = arguments.split()
        for source in sources:
            assert (REPO / source).exists(), source
            folders = [Path(source.rstrip("/")), *Path(source.rstrip("/")).parents]
            assert any(str(folder) in admitted for folder in folders), f"{source} is excluded by .dockerignore"


def test_the_image_builds_the_package_from_the_folder_it_lives_in():
    """`pip install .` in the image needs the folder the package is found in (pyproject.toml's
    `packages.find`) and the wire contract its stubs are generated from."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"]["find"]["include"] == ["dyad*"]
    copied = set()
    for keyword, arguments in dockerfile_instructions((REPO / "Dockerfile").read_text()):
        if keyword == "COPY" and not arguments.startswith("--from"):
            *sources, destination = arguments.split()
            if destination.startswith("/tmp/src/"):
                copied |= {source.rstrip("/") for source in sources}
    assert {"dyad", "proto"} <= copied, f"not copied into the build: {sorted({'dyad', 'proto'} - copied)}"
