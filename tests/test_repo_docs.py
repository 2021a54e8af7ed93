"""The README's first two commands are the documented entry points; CI runs the second."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text().split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in text.strip().splitlines()]


def test_readme_starts_with_serve_and_test_commands():
    serve, test = readme_commands()[:2]
    assert serve.startswith("scripts/setup.sh") and "manta serve" in serve
    assert test.startswith("scripts/setup.sh") and "pytest" in test


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1].strip()
    assert ci == readme_commands()[1]
