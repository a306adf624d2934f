import os

CSV = "/home/user/data/sales.csv"


def test_csv_present():
    assert os.path.isfile(CSV), f"{CSV} is missing"
    with open(CSV, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert lines[0] == "region,product,amount"
    assert len(lines) == 7, f"expected 6 data rows, got {len(lines) - 1}"


def test_total_absent():
    assert not os.path.exists("/home/user/data/total.txt"), "total.txt must not exist yet"
