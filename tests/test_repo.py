"""The README's two commands are the ones CI runs."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```bash") + 1
    return lines[start : lines.index("```", start)]


def test_readme_opens_with_the_two_commands_and_ci_runs_them():
    commands = readme_commands()
    assert len(commands) == 2 and "examples/quickstart.sh" in commands[0] and "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert command in ci, f"CI does not run the README's command: {command}"
    assert ci.index("pip install torch==2.13.0") < ci.index(commands[1])
