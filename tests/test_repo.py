"""The README's two commands are the ones CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```bash") + 1
    return lines[start : lines.index("```", start)]


def test_readme_opens_with_the_two_commands_and_ci_runs_them():
    commands = readme_commands()
    assert (
        len(commands) == 2 and "examples/quickstart.sh" in commands[0] and "pytest" in commands[1]
    )
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert command in ci, f"CI does not run the README's command: {command}"
    assert ci.index("pip install torch==2.13.0") < ci.index(commands[1])


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages one by one (the top-level folders install under
    megafp8.*): a package folder missing from it works in an editable install and is absent from
    a wheel."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    found = set()
    for name, folder in folders.items():
        found |= {
            ".".join([name, *init.parent.relative_to(folder).parts])
            for init in folder.rglob("__init__.py")
        }
    assert found == set(setuptools["packages"])
