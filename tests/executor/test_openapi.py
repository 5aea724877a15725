"""The API's generated OpenAPI schema is valid, covers API.md, and its docs page works offline."""

from __future__ import annotations

import re
from typing import Any

import pytest
from openapi_spec_validator import validate

from tests.support.api import ApiClient

API = "/api/v1"
# Every operation of API.md's table.
API_MD_OPERATIONS = [
    ("get", "/api/v1/tools"),
    ("post", "/api/v1/runs"),
    ("get", "/api/v1/runs/{run_id}"),
    ("post", "/api/v1/runs/{run_id}/steps"),
    ("get", "/api/v1/runs/{run_id}/steps"),
    ("get", "/api/v1/steps/{step_id}"),
    ("post", "/api/v1/runs/{run_id}/cancel"),
    ("get", "/api/v1/runs/{run_id}/report"),
]


@pytest.fixture
def schema(anonymous_api: ApiClient) -> dict[str, Any]:
    response = anonymous_api.get(f"{API}/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_the_schema_is_public_and_valid_openapi_3(schema: dict[str, Any]) -> None:
    validate(schema)

    assert schema["openapi"].startswith("3.")
    assert schema["info"]["title"] == "Stepward"


def test_the_schema_has_every_operation_of_api_md(schema: dict[str, Any]) -> None:
    present = {(method, path) for path, item in schema["paths"].items() for method in item}

    assert set(API_MD_OPERATIONS) <= present


def test_every_operation_needs_the_bearer_token(schema: dict[str, Any]) -> None:
    schemes = schema["components"]["securitySchemes"]

    assert [scheme for scheme in schemes.values() if scheme["scheme"] == "bearer"]
    for method, path in API_MD_OPERATIONS:
        assert schema["paths"][path][method]["security"], (method, path)


def test_the_step_answer_names_failure_class_and_never_input(schema: dict[str, Any]) -> None:
    components = schema["components"]["schemas"]
    step = components["StepOut"]["properties"]

    assert "input" not in step
    assert "input_summary" in step
    assert set(components["FailureOut"]["properties"]) == {"class", "message"}


def test_every_operation_documents_the_error_shape(schema: dict[str, Any]) -> None:
    for method, path in API_MD_OPERATIONS:
        responses = schema["paths"][path][method]["responses"]
        assert {"401", "429"} <= set(responses), (method, path)
        error = responses["401"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorOut"}


# What each operation can answer, and why (API.md's errors): 401 and 429 everywhere (a bad
# token, the agent's rate, bad tokens per address); a JSON body adds 400 (not JSON, or a bad
# Content-Length), 411 (a chunked body where the server cannot read one), 413 and 422; query
# parameters add 422; an id in the path adds 404; a service's refusal adds 403 and 409.
BODY = {"400", "411", "413", "422"}
EXPECTED_STATUSES = {
    ("get", "/api/v1/tools"): {"200"},
    ("post", "/api/v1/runs"): {"200", "201", *BODY, "403", "409"},
    ("get", "/api/v1/runs/{run_id}"): {"200", "404"},
    ("post", "/api/v1/runs/{run_id}/steps"): {"200", "201", *BODY, "403", "404", "409"},
    ("post", "/api/v1/runs/{run_id}/steps/batch"): {"200", "201", *BODY, "403", "404", "409"},
    ("get", "/api/v1/runs/{run_id}/steps"): {"200", "404", "422"},
    ("get", "/api/v1/steps/{step_id}"): {"200", "404", "422"},
    ("post", "/api/v1/runs/{run_id}/cancel"): {"200", *BODY, "403", "404", "409"},
    ("get", "/api/v1/runs/{run_id}/report"): {"200", "404", "422"},
}


def test_every_operation_declares_every_status_it_can_answer(schema: dict[str, Any]) -> None:
    declared = {
        (method, path): set(operation["responses"])
        for path, item in schema["paths"].items()
        for method, operation in item.items()
        if path.startswith("/api/v1/")
        and "responses" in operation
        and path not in ("/api/v1/openapi.json", "/api/v1/docs")
    }

    assert declared == {
        operation: {*statuses, "401", "429"} for operation, statuses in EXPECTED_STATUSES.items()
    }


def test_max_cost_is_a_decimal_string_in_the_schema(schema: dict[str, Any]) -> None:
    max_cost = schema["components"]["schemas"]["BudgetIn"]["properties"]["max_cost"]
    [text, number, none] = max_cost["anyOf"]
    pattern = re.compile(text["pattern"])

    assert text["type"] == "string"
    # A JSON number is still taken, and said to be on its way out.
    assert number["type"] == "number"
    assert number["deprecated"] is True
    assert none == {"type": "null"}
    for good in ["0", "12.5", "9999999999.9999", "0.0001"]:
        assert pattern.search(good), good
    for bad in ["", "1e3", "-1", "+1", "1.23456", "12345678901", "NaN", " 1", "1.", ".5", "abc"]:
        assert not pattern.search(bad), bad


def test_text_fields_say_they_take_no_nul(schema: dict[str, Any]) -> None:
    run = schema["components"]["schemas"]["RunIn"]["properties"]
    pattern = re.compile(run["name"]["pattern"])

    assert pattern.search("any text, 検査 🚀")
    assert not pattern.search("nul\x00byte")


def test_the_docs_page_renders_without_a_token_or_a_cdn(
    anonymous_api: ApiClient, settings: Any
) -> None:
    # Without collectstatic there is no manifest for the deployed storage to look names up in.
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }

    response = anonymous_api.get(f"{API}/docs")

    assert response.status_code == 200
    page = response.content.decode()
    assert f"{API}/openapi.json" in page
    assert "/static/ninja/swagger-ui-bundle.js" in page
    assert not re.search(r"""(src|href)=["']https?://""", page)


def test_the_docs_assets_are_served_locally(anonymous_api: ApiClient) -> None:
    response = anonymous_api.get("/static/ninja/swagger-ui-bundle.js")

    assert response.status_code == 200
