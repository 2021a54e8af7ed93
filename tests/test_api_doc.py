"""docs/api.md lists every field of every POST body, as the server's OpenAPI document states it:
no field of the API is missing from the page, and the page names no field the API lacks."""

from __future__ import annotations

import re
from pathlib import Path

from cluster.api.openapi import openapi_schema

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def _doc_tables() -> dict[str, dict[str, str]]:
    """route -> {field: status} from the page's tables (one per `## \\`POST route\\`` heading)."""
    tables: dict[str, dict[str, str]] = {}
    route = None
    for line in DOC.read_text().splitlines():
        m = re.match(r"## `POST (\S+)`", line)
        if m:
            route = m.group(1)
            tables[route] = {}
            continue
        m = re.match(r"\| `([a-z_]+)` \| (supported|refused) \|", line)
        if m and route is not None:
            assert m.group(1) not in tables[route], f"{route}: {m.group(1)} listed twice"
            tables[route][m.group(1)] = m.group(2)
    return tables


def test_every_body_field_is_on_the_page_and_no_other():
    schema = openapi_schema()
    components = schema["components"]["schemas"]
    tables = _doc_tables()
    routes = {}
    for path, item in schema["paths"].items():
        post = item.get("post")
        if post and "requestBody" in post:
            ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
            routes[path] = set(components[ref]["properties"])
    assert set(tables) == set(routes)
    for path, fields in routes.items():
        assert set(tables[path]) == fields, (path, fields ^ set(tables[path]))
