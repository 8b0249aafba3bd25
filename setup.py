"""The one thing pyproject.toml cannot say: the shipped configs and evaluation sets go into the package.

The repository keeps `configs/` and `data/benchmarks/` at its root, where users edit them. A regular build
(a wheel, `pip install <clone>`) copies them into the package as `trapo/_shipped/configs/` and
`trapo/_shipped/benchmarks/`, so an installed `trapo` finds them from any directory (trapo/resources.py).
An editable install copies nothing: the package is the clone's `trapo/`, and the resolver reads the clone's
own folders.

Why not pyproject.toml's package-dir mapping (`"trapo._shipped.configs" = "configs"` plus package-data), as
tried with setuptools 78.1: `packages.find` does not see mapped packages (the wheel had none of the files);
with every package listed by hand the wheel has them, but each data subfolder (slurm/, studies/toy/, ...)
draws a warning that it is "absent from the `packages` configuration", and the editable install becomes an
import hook (a generated finder mapping the packages) instead of the one .pth line of the simple layout.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# repository folder -> its place under trapo/_shipped/ (trapo/resources.py SHIPPED names the same)
SHIPPED = {"configs": "configs", "data/benchmarks": "benchmarks"}


def shipped_files():
    """(file in the repository, its path under the build's trapo/_shipped/) of every shipped file."""
    for source, name in SHIPPED.items():
        for path in sorted((HERE / source).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                yield path, Path(name) / path.relative_to(HERE / source)


class BuildWithShipped(build_py):
    """build_py, then the shipped files copied into the built package; nothing more in editable mode."""

    def target(self, rel: Path) -> Path:
        return Path(self.build_lib) / "trapo" / "_shipped" / rel

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for path, rel in shipped_files():
            self.mkpath(str(self.target(rel).parent))
            self.copy_file(str(path), str(self.target(rel)))

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [str(self.target(rel)) for _, rel in shipped_files()]


setup(cmdclass={"build_py": BuildWithShipped})
