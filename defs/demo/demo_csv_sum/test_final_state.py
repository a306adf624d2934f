import os

CSV = "/home/user/data/sales.csv"
TOTAL = "/home/user/data/total.txt"


def test_total_value():
    assert os.path.isfile(TOTAL), f"{TOTAL} was not created"
    with open(TOTAL, encoding="utf-8") as f:
        content = f.read()
    assert content.strip() == "800", f"wrong total: {content!r} (expected 800)"
    assert content.endswith("\n"), "the total must end with a newline"


def test_csv_unchanged():
    with open(CSV, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) == 7 and lines[0] == "region,product,amount", "sales.csv was modified"
