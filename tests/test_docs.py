"""The docs stay true: the API reference matches the docstrings, and every
public function has a docstring with an example."""

import importlib
import inspect
import os
import runpy

import pytest

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def test_api_reference_is_up_to_date():
    make_api = runpy.run_path(os.path.join(DOCS, "make_api.py"))
    with open(os.path.join(DOCS, "api.md")) as f:
        committed = f.read()
    assert committed == make_api["render"](), "docs/api.md is stale: run python docs/make_api.py"


def test_public_functions_have_an_example():
    make_api = runpy.run_path(os.path.join(DOCS, "make_api.py"))
    for module_name, names in make_api["PUBLIC"]:
        module = importlib.import_module(module_name)
        for name in names:
            obj = getattr(module, name)
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                continue
            doc = inspect.getdoc(obj) or ""
            assert "Example" in doc and ">>>" in doc, f"{module_name}.{name} has no example"


@pytest.mark.parametrize("page", sorted(name for name in os.listdir(DOCS) if name.endswith(".md")))
def test_pages_exist_and_links_resolve(page):
    path = os.path.join(DOCS, page)
    with open(path) as f:
        text = f.read()
    import re

    for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", text):
        assert os.path.exists(os.path.join(DOCS, target)), f"{page} links to missing {target}"
