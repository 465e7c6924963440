"""The Java runtime ScienceWorld's simulator needs (a Scala program in a jar, Java 8 or newer).

``check_java()`` finds the ``java`` executable (``$JAVA_HOME/bin/java`` first, then ``PATH``),
runs ``java -version`` and returns the path and major version, or raises :class:`JavaNotFoundError`
with a one-line message saying how to install it on this system. Set-up scripts can call the
module directly: ``python -m qevolve.environments.sciworld.java`` prints the runtime found and
exits 0, or prints the problem and exits 2; ``--install-command`` prints the command that would
install a runtime here (empty, exit 1, where none is known).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MIN_JAVA_MAJOR = 8  # the simulator's classes are compiled for Java 8 (class file version 52)
DEBIAN_INSTALL_COMMAND = "apt-get install -y default-jre-headless"


class JavaNotFoundError(FileNotFoundError):
    """No usable Java runtime: ScienceWorld cannot start its simulator (a user error: the CLI
    prints the one-line message and exits 2)."""


@dataclass(frozen=True)
class JavaRuntime:
    path: str
    major: int
    version_line: str


def is_debian_like(os_release: Path = Path("/etc/os-release")) -> bool:
    """True on Debian, Ubuntu and their derivatives (where apt-get installs a JRE)."""
    if Path("/etc/debian_version").exists():
        return True
    try:
        text = os_release.read_text()
    except OSError:
        return False
    ids = re.findall(r'^(?:ID|ID_LIKE)="?([^"\n]*)"?', text, flags=re.MULTILINE)
    return any(word in ("debian", "ubuntu") for line in ids for word in line.split())


def install_hint() -> str:
    if is_debian_like():
        return f"install one with `{DEBIAN_INSTALL_COMMAND}` (as root)"
    return ("install a Java runtime (Java 8 or newer, e.g. from your package manager or "
            "https://adoptium.net) and put `java` on PATH or set JAVA_HOME")


def find_java(java_path: str | None = None) -> str | None:
    """The java executable to use: ``java_path`` if given, else $JAVA_HOME/bin/java, else PATH."""
    if java_path:
        return java_path if (os.path.isfile(java_path) or shutil.which(java_path)) else None
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.is_file():
            return str(candidate)
    return shutil.which("java")


def parse_java_major(version_output: str) -> int | None:
    """Major version from ``java -version`` output ('1.8.0_392' -> 8, '17.0.15' -> 17)."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if not match:
        match = re.search(r"\b(?:openjdk|java) (\d+)(?:\.(\d+))?", version_output)
        if not match:
            return None
    major = int(match.group(1))
    if major == 1 and match.group(2):  # the old "1.x" scheme
        major = int(match.group(2))
    return major


def check_java(java_path: str | None = None, timeout: float = 30.0) -> JavaRuntime:
    """Return the Java runtime ScienceWorld will use, or raise :class:`JavaNotFoundError`."""
    path = find_java(java_path)
    if path is None:
        where = f"java_path={java_path!r}" if java_path else "no `java` on PATH and no JAVA_HOME"
        raise JavaNotFoundError(f"ScienceWorld needs a Java runtime ({where}); {install_hint()}")
    try:
        run = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise JavaNotFoundError(f"ScienceWorld needs a Java runtime; `{path} -version` failed ({err}); "
                                f"{install_hint()}") from None
    output = (run.stderr or "") + (run.stdout or "")
    major = parse_java_major(output)
    if run.returncode != 0 or major is None:
        first = output.strip().splitlines()[0] if output.strip() else f"exit code {run.returncode}"
        raise JavaNotFoundError(f"ScienceWorld needs a Java runtime; `{path} -version` answered {first!r}; "
                                f"{install_hint()}")
    if major < MIN_JAVA_MAJOR:
        raise JavaNotFoundError(f"ScienceWorld needs Java {MIN_JAVA_MAJOR} or newer, {path} is Java {major}; "
                                f"{install_hint()}")
    return JavaRuntime(path, major, output.strip().splitlines()[0])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--install-command" in args:
        if is_debian_like():
            print(DEBIAN_INSTALL_COMMAND)
            return 0
        return 1
    try:
        runtime = check_java()
    except JavaNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"java {runtime.major} at {runtime.path} ({runtime.version_line})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
