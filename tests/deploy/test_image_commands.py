"""The image commands in the docs run as written: copied out of the docs, each is checked against the repository.

The commands are the fenced blocks that follow an ``image-commands`` marker comment in README.md and
docs/deploy.md, and the build command in docker/examples/own-code.Dockerfile's header. The default suite checks
what needs no container engine: every flag `docker/build.sh` is given parses (its --help names it, and it runs
to the end with stand-in tools); every buildah and podman command uses build.sh's image store, and a build on a
local image says --pull=never; every Dockerfile, build context, build argument and `CHECK` reference exists;
every mount target is where the images and the chart put that file; the shell lines that write the configs run,
and give each client on the shared host network its own metrics port.

The slow suite (`python -m pytest -m slow`, as root on a machine with buildah, such as a CI runner building
images) runs the build commands themselves, except those that pull a remote torch base.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.deploy.test_build_script import _calls

MARK = "<!-- image-commands: tests/deploy/test_image_commands.py checks these -->"
DOCS = (REPO / "README.md", REPO / "docs" / "deploy.md")
OWN_CODE = REPO / "docker" / "examples" / "own-code.Dockerfile"
BUILD_SH = REPO / "docker" / "build.sh"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
TARGETS = ("aggregator", "client", "all", "example")
BUILT = {f"localhost/hetfed-{name}:{VERSION}" for name in ("aggregator", "client", "client-example")}
# Where build.sh mounts the build CA, and the build argument that points pip at it.
BUILD_CA = "/run/hetfed-build-ca.crt"


def marked_blocks(path: Path) -> list[str]:
    """The fenced blocks right after an image-commands marker."""
    return re.findall(re.escape(MARK) + r"\n```[a-z]*\n(.*?)```", path.read_text(), flags=re.S)


def own_code_header_block() -> str:
    """The build command of own-code.Dockerfile's header, its comment marks taken off."""
    lines = OWN_CODE.read_text().splitlines()
    start = lines.index("#   store=build/images")
    stop = next(i for i in range(start, len(lines)) if not lines[i].startswith("#   "))
    return "\n".join(line[4:] for line in lines[start:stop]) + "\n"


def all_blocks() -> list[tuple[str, str]]:
    """(where, block) of every command block the docs mark, and the Dockerfile's header command."""
    blocks = [(f"{path.relative_to(REPO)} block {i}", b) for path in DOCS for i, b in enumerate(marked_blocks(path))]
    return [*blocks, (str(OWN_CODE.relative_to(REPO)), own_code_header_block())]


VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


@dataclass
class Shell:
    """The few shell rules the documented commands use: `name=value`, `$name`, `${name:-default}`."""

    variables: dict[str, str] = field(default_factory=lambda: {"PWD": str(REPO)})

    def expand(self, text: str) -> str:
        def one(m: re.Match[str]) -> str:
            name = m.group(1) or m.group(3)
            value = self.variables.get(name, "")
            return value if value or m.group(2) is None else self.expand(m.group(2))
        return VAR.sub(one, text)

    def commands(self, block: str) -> list[list[str]]:
        """The block's commands as words, assignments applied, comments dropped, `for` loops unrolled."""
        lines = re.sub(r"\\\n", " ", block).splitlines()
        out: list[list[str]] = []
        while lines:
            line = lines.pop(0)
            loop = re.fullmatch(r"\s*for (\w+) in ([^;]+); do\s*", line)
            if loop:
                end = next(i for i, body in enumerate(lines) if body.strip() == "done")
                body, lines = "\n".join(lines[:end]), lines[end + 1:]
                for value in shlex.split(self.expand(loop.group(2))):
                    self.variables[loop.group(1)] = value
                    out += self.commands(body)
                continue
            words = shlex.split(self.expand(line), comments=True)
            if not words:
                continue
            if len(words) == 1 and re.fullmatch(r"\w+=.*", words[0]):
                name, _, value = words[0].partition("=")
                self.variables[name] = value
                continue
            out.append(words)
        return out


def build_sh_storage() -> list[str]:
    """build.sh's storage flags with its default store, relative to the repository."""
    text = BUILD_SH.read_text()
    store = re.search(r"^store=\$\{HETFED_IMAGE_STORE:-\$PWD/([^}]+)\}$", text, re.M)
    flags = re.search(r"^storage=\((.*)\)$", text, re.M)
    assert store and flags, "build.sh's store or storage flags moved: update this test"
    return [w.replace("$store", store.group(1)) for w in shlex.split(flags.group(1))]


def relative(word: str) -> str:
    """A path word relative to the repository when it lies in it."""
    return os.path.relpath(word, REPO) if word.startswith(str(REPO)) else word


def options(words: list[str], with_value: set[str]) -> tuple[dict[str, list[str]], list[str]]:
    """{option: values} and the positional words of a command line."""
    opts: dict[str, list[str]] = {}
    positional = []
    i = 0
    while i < len(words):
        word = words[i]
        if word in with_value:
            opts.setdefault(word, []).append(words[i + 1])
            i += 2
            continue
        if word.startswith("-"):
            name, eq, value = word.partition("=")
            opts.setdefault(name, []).append(value if eq else "")
        else:
            positional.append(word)
        i += 1
    return opts, positional


def help_text() -> str:
    proc = subprocess.run(["bash", str(BUILD_SH), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def check_build_sh(words: list[str], tmp_path: Path) -> None:
    """Its flags are the ones --help names, its target one it builds, and it runs through with stand-in tools."""
    shown = help_text()
    opts, positional = options(words[1:], {"--torch-base", "--torch-index"})
    for flag in opts:
        assert re.search(rf"^\s+{re.escape(flag)}\b", shown, re.M), f"{flag} is not in docker/build.sh --help"
    assert set(positional) <= set(TARGETS), positional
    _calls(tmp_path / str(len(list(tmp_path.iterdir()))), words[1:], have_images=False)


def check_storage(words: list[str]) -> list[str]:
    """The tool's storage flags are build.sh's; the words after them."""
    storage = build_sh_storage()
    given = [relative(w) for w in words[1:1 + len(storage)]]
    assert given == storage, f"{words[0]} must use build.sh's store: {storage}, got {given}"
    return words[1 + len(storage):]


def check_bud(words: list[str]) -> str:
    """A build: its Dockerfile, context, build arguments, base, check and CA mount exist and agree; its tag."""
    opts, positional = options(words, {"--build-arg", "-v", "-f", "-t", "--isolation"})
    (dockerfile,), (tag,), (context,) = opts["-f"], opts["-t"], positional[1:]
    path, ctx = REPO / relative(dockerfile), REPO / relative(context)
    assert path.is_file() and ctx.is_dir(), (dockerfile, context)
    declared = set(re.findall(r"^ARG (\w+)", path.read_text(), re.M))
    args = dict(a.split("=", 1) for a in opts.get("--build-arg", []))
    assert set(args) <= declared, f"{sorted(set(args) - declared)} not declared in {dockerfile}"
    base = args.get("BASE", "")
    if base.startswith("localhost/"):
        assert base in BUILT, f"{base} is not an image docker/build.sh makes"
        assert opts.get("--pull") == ["never"], "a build on a local image must not try to pull it"
    if "CHECK" in args:
        module, _, function = args["CHECK"].partition(":")
        source = ctx / (module.replace(".", "/") + ".py")
        assert source.is_file() and re.search(rf"^def {function}\(", source.read_text(), re.M), args["CHECK"]
    for mount in opts.get("-v", []):
        _, target, mode = mount.split(":")
        assert (target, mode, args.get("PIP_CERT")) == (BUILD_CA, "ro", BUILD_CA), mount
        assert f'-v "$(realpath "$ca"):{BUILD_CA}:ro"' in BUILD_SH.read_text()
    return tag


def image_mount_targets() -> dict[str, set[str]]:
    """Where each image's files go: its command's config, its state, the chart's mounts, the TLS directory."""
    def command_config(dockerfile: str) -> str:
        cmd = re.search(r'^CMD \[(.*)\]$', (REPO / "docker" / dockerfile).read_text(), re.M)
        assert cmd
        words = [w.strip().strip('"') for w in cmd.group(1).split(",")]
        return words[words.index("--config") + 1]

    chart = REPO / "helm" / "hetfed"
    tls = re.search(r'define "hetfed.tlsDir" -}}([^{]+){{', (chart / "templates" / "_helpers.tpl").read_text())
    assert tls
    values = yaml.safe_load((chart / "values.yaml").read_text())["clientDefaults"]
    aggregator_mounts = re.findall(r"mountPath: (/[\w/.-]+)$",
                                   (chart / "templates" / "statefulset-aggregator.yaml").read_text(), re.M)
    return {
        f"localhost/hetfed-aggregator:{VERSION}": {command_config("aggregator.Dockerfile"), tls.group(1),
                                                   *aggregator_mounts},
        f"localhost/hetfed-client:{VERSION}": {command_config("client.Dockerfile"), tls.group(1),
                                               values["dataVolume"]["mountPath"],
                                               values["stateVolume"]["mountPath"],
                                               values["outputVolume"]["mountPath"]},
    }


@dataclass
class RunCheck:
    """What a `podman run` mounts: image, {target: source}, and the config the container reads."""

    image: str
    mounts: dict[str, str]
    config: str


def check_run(words: list[str]) -> RunCheck:
    """A container: a built image, mounts where the image and chart put files, a config it mounts."""
    # The first word that is no option, nor an option's value, is the image; the rest is its command.
    at = next(i for i in range(1, len(words)) if not words[i].startswith("-")
              and words[i - 1] not in ("-v", "--name", "--network", "-p"))
    opts, _ = options(words[1:at], {"-v", "--name", "--network", "-p"})
    image, *command = words[at:]
    targets = image_mount_targets()
    assert image in targets, f"{image} is not an image docker/build.sh makes"
    config_dir = os.path.dirname(next(t for t in targets[image] if t.endswith(".toml")))
    mounts = {}
    for mount in opts.get("-v", []):
        source, target, *_ = mount.split(":")
        chart_config = target.startswith(config_dir + "/") and target.endswith(".toml")
        assert target in targets[image] or chart_config, f"{target} is not where {image} or the chart has it"
        mounts[target] = source
    cmd = re.search(r'^CMD \[(.*)\]$', (REPO / "docker" / ("aggregator.Dockerfile" if "aggregator" in image
                                                         else "client.Dockerfile")).read_text(), re.M)
    assert cmd
    default = [w.strip().strip('"') for w in cmd.group(1).split(",")]
    args = command or default
    config = args[args.index("--config") + 1]
    assert config in mounts, f"{image} reads {config}, which nothing mounts"
    return RunCheck(image, mounts, config)


def test_the_docs_mark_their_image_commands() -> None:
    """The marked blocks exist where the docs build, push and run images (a lost marker would hide them)."""
    blocks = all_blocks()
    assert len(blocks) == 6, [where for where, _ in blocks]
    text = "".join(b for _, b in blocks)
    for needle in ("docker/build.sh --torch-base", " bud ", " push ", "$podman run", "--pull=never"):
        assert needle in text, needle


@pytest.mark.parametrize(("where", "block"), all_blocks(), ids=[w for w, _ in all_blocks()])
def test_each_image_command_matches_the_repository(where: str, block: str, tmp_path: Path) -> None:
    """build.sh parses its flags; buildah and podman use its store; builds, pushes and runs name real things."""
    shell = Shell()
    built = set(BUILT)
    checked = 0
    for words in shell.commands(block):
        tool = words[0]
        if tool == "docker/build.sh":
            check_build_sh(words, tmp_path)
        elif tool in ("buildah", "podman"):
            rest = check_storage(words)
            if rest[0] in ("bud", "build"):
                built.add(check_bud(rest))
            elif rest[0] == "push":
                assert rest[1] in built and rest[2].startswith("docker://"), rest
            elif rest[0] == "run":
                check_run(rest)
            else:
                pytest.fail(f"{where}: no check for `{tool} {rest[0]}`")
        else:
            continue
        checked += 1
    assert checked, f"{where} has no image command"


def test_the_containers_on_one_host_get_their_configs_and_ports_apart(tmp_path: Path) -> None:
    """The shell lines of the no-Kubernetes block run as written; each client's config is the one mounted for
    it, dials the aggregator on the host, joins a run the aggregator's config declares, and binds its own
    metrics port; the aggregator's state_dir is the mounted state."""
    (block,) = [b for b in marked_blocks(REPO / "docs" / "deploy.md") if "$podman run" in b]
    (tmp_path / "docs").symlink_to(REPO / "docs")
    script = "\n".join(line for line in re.sub(r"\\\n", " ", block).splitlines()
                       if not line.lstrip().startswith("$podman"))
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    runs = [check_run(check_storage(w)) for w in Shell({"PWD": str(tmp_path)}).commands(block)
            if w[0] == "podman"]
    aggregator, *clients = runs
    server = tomllib.loads(Path(aggregator.mounts[aggregator.config]).read_text())
    assert server["server"]["state_dir"] in aggregator.mounts
    port = server["server"]["listen"].rsplit(":", 1)[1]
    ports = []
    assert len(clients) == 2
    for run in clients:
        cfg = tomllib.loads(Path(run.mounts[run.config]).read_text())
        assert cfg["aggregator"] == f"127.0.0.1:{port}"
        assert cfg["run"] in {r["id"] for r in server["runs"]}
        assert cfg["organization"] in next(r for r in server["runs"] if r["id"] == cfg["run"])["organizations"]
        assert cfg["data"]["path"] in run.mounts
        ports.append(cfg["metrics_port"])
    assert len(set(ports)) == len(ports) and server["server"]["metrics_port"] not in ports, ports


def builder() -> str | None:
    """Why the build commands cannot run here, or None where they can."""
    if not shutil.which("buildah"):
        return "no buildah on PATH"
    if os.geteuid() != 0:
        return "docker/build.sh needs root (debootstrap, chroot isolation)"
    return None


@pytest.mark.slow
def test_the_build_commands_run_as_written() -> None:
    """Each marked build.sh and buildah bud command, run as written from the repository's root, exits 0.

    A command that pulls a remote torch base (--torch-base docker.io/...) is left out: gigabytes from a registry.
    """
    if reason := builder():
        pytest.skip(reason)
    for where, block in all_blocks():
        lines = []
        for raw in re.sub(r"\\\n", " ", block).splitlines():
            line = raw.strip()
            assignment = re.match(r"\w+=\S", line)
            local_build = line.startswith("docker/build.sh") and "--torch-base" not in line
            bud = line.startswith("buildah") and re.search(r"\s(bud|build)\s", line)
            if assignment or local_build or bud:
                lines.append(line)
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(lines)], cwd=REPO, capture_output=True,
                              text=True, timeout=3600)
        assert proc.returncode == 0, f"{where}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
