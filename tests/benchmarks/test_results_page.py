"""scripts/benchmarks/RESULTS.md is generated from the JSON result files: regenerated here, it equals the committed
page, and every row names a date, a machine and result files that exist."""

import re

import results_page  # scripts/benchmarks is on sys.path (conftest.py)


def rows(text: str) -> list[list[str]]:
    """The cells of every table row of the page, header and separator rows left out."""
    found = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith("| what |"):
            continue
        found.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return found


def test_the_committed_page_is_what_the_json_files_give(tmp_path):
    output = tmp_path / "RESULTS.md"
    assert results_page.main(["--output", str(output)]) == 0
    assert output.read_text() == results_page.PAGE.read_text(), (
        "scripts/benchmarks/RESULTS.md is stale: run python scripts/benchmarks/results_page.py"
    )
    assert results_page.main(["--output", str(output), "--check"]) == 0
    output.write_text(output.read_text() + "a figure typed by hand\n")
    assert results_page.main(["--output", str(output), "--check"]) == 1


def test_every_row_has_a_figure_command_date_machine_and_existing_result_files():
    table = rows(results_page.page())
    assert len(table) == sum(len(section) for _, section in results_page.SECTIONS) >= 30
    for what, figure, command, date, machine, results in table:
        assert what and figure and command.startswith("`"), what
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}( to \d{4}-\d{2}-\d{2})?", date), (what, date)
        assert machine, what
        links = re.findall(r"\]\(([^)]+)\)", results)
        assert links and links[0].endswith(".json"), what
        for link in links:
            assert (results_page.HERE / link).is_file(), (what, link)


def test_every_result_json_is_on_the_page():
    """A results file no row reads is a figure a newcomer cannot find."""
    shown = {row.file for _, section in results_page.SECTIONS for row in section}
    for folder in ("benchmarks/results", "research/results"):
        for path in sorted((results_page.SCRIPTS / folder).glob("*.json")):
            assert f"{folder}/{path.name}" in shown, path


def test_machines_are_written_as_cores_cpu_and_gpu():
    describe = results_page.describe_machine
    assert describe({"cores": 2, "cpu": "Intel(R) Xeon(R) Processor @ 2.50GHz", "gpu": None}) == "2-core Intel Xeon"
    assert describe({"cores": 16, "cpu": "AMD EPYC", "gpu": "NVIDIA H100"}) == "16-core AMD EPYC, NVIDIA H100"
    assert describe("2-core CPU, model not recorded") == "2-core CPU, model not recorded"


def test_every_figure_of_the_readme_results_table_is_on_the_page():
    """The README quotes headline figures only: each number of its Results table is a number of a row of the page,
    and a date it names is that row's date, so every figure a user reads leads to its command, date and machine."""
    readme = (results_page.SCRIPTS.parent / "README.md").read_text()
    table = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    page_rows = rows(results_page.PAGE.read_text())
    number = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?![\w,]*\d)")
    quoted = rows(table)
    assert len(quoted) >= 5

    def numbers(text: str) -> list[str]:
        return number.findall(re.sub(r"[-–/]", " ", text))

    for what, figure in quoted:
        for date in re.findall(r"\d{4}-\d{2}-\d{2}", figure):
            assert any(date in r[3] for r in page_rows), f"README Results row {what!r}: no row of {date}"
        # The figures, without the dates and machines (checked above, and the page's own columns).
        for token in numbers(re.sub(r"\d{4}-\d{2}-\d{2}|\d+-core", "", figure)):
            assert any(token in numbers(r[1]) for r in page_rows), f"README row {what!r}: {token} is not on the page"
