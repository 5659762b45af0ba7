"""One error taxonomy: every member states a category and the HTTP status the Tinker contract implies, the old names
are the taxonomy's types, and the API's one mapping (api/http_errors.py) answers what the taxonomy says."""

from __future__ import annotations

import pytest
from temporalio.api.failure.v1 import Failure
from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.converter import DataConverter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from tinkerflow.api.http_errors import failure_category, from_error, from_temporal
from tinkerflow.common import errors
from tinkerflow.common.errors import TEMPORAL_ERRORS, Category, TinkerflowError
from tinkerflow.common.quotas import QuotaFileError
from tinkerflow.common.settings import SettingsError
from tinkerflow.workflows.protocol.error_types import ErrorType

# What the contract implies for each (docs/wire-contract.md §Futures, §Errors and retries; docs/architecture.md §What
# tenancy promises): a user's mistake is a 4xx with a body that the SDK does not retry, except 409 (a seq_id conflict,
# retried with the same body: the first answer wins); the service's trouble is a 5xx the SDK retries; another tenant's
# object is a 404, as a missing one.
EXPECTED_EXCEPTIONS = {
    errors.InputError: (Category.USER, 400),
    errors.CustomLossError: (Category.USER, 400),  # a custom loss graph refused: a failed future naming the op
    errors.UnknownModelError: (Category.USER, 400),
    errors.CheckpointError: (Category.USER, 400),
    errors.CheckpointNotFound: (Category.USER, 404),
    errors.BadRequestId: (Category.USER, 404),  # docs/wire-contract.md §Futures: unknown (or foreign) request ids ⇒ 404
    errors.UserError: (Category.USER, 400),
    SettingsError: (Category.USER, 400),  # a bad TINKERFLOW_* variable; the CLI exits 2 with it
    QuotaFileError: (Category.USER, 400),  # a quota file refused at start (the CLI exits 2) or kept out on SIGHUP
    errors.StoreError: (Category.SERVER, 503),
    errors.TinkerflowError: (Category.SERVER, 500),
}
EXPECTED_TYPES = {
    ErrorType.SEQ_CONFLICT: (Category.USER, 409),
    ErrorType.SEQ_TOO_FAR: (Category.USER, 400),
    ErrorType.NOT_OWNER: (Category.USER, 404),
    ErrorType.RUN_CLOSED: (Category.USER, 400),
    ErrorType.SESSION_ENDED: (Category.USER, 400),
    ErrorType.UNKNOWN_SAMPLER: (Category.USER, 400),
    ErrorType.ADAPTER_LOST: (Category.SERVER, 503),
    ErrorType.WORKER_LOST: (Category.SERVER, 503),
}


def _all_subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    return found | {s for c in found for s in _all_subclasses(c)}


def test_every_exception_in_the_taxonomy_is_listed_here():
    assert _all_subclasses(TinkerflowError) | {TinkerflowError} == set(EXPECTED_EXCEPTIONS)


@pytest.mark.parametrize("cls", list(EXPECTED_EXCEPTIONS), ids=lambda c: c.__name__)
def test_each_exception_maps_to_the_status_the_contract_implies(cls):
    category, status = EXPECTED_EXCEPTIONS[cls]
    assert (cls.category, cls.http_status) == (category, status)
    assert (400 <= status < 500) == (category is Category.USER)
    e = from_error(cls("what went wrong"))
    # never an empty body (docs/wire-contract.md §Errors and retries)
    assert e.status_code == status and e.detail == "what went wrong"


def test_every_temporal_error_type_has_an_entry():
    assert set(TEMPORAL_ERRORS) == set(ErrorType) == set(EXPECTED_TYPES)


@pytest.mark.parametrize("error_type", list(ErrorType), ids=str)
def test_each_temporal_type_maps_to_its_status_and_category(error_type):
    category, status = EXPECTED_TYPES[error_type]
    assert (TEMPORAL_ERRORS[error_type].category, TEMPORAL_ERRORS[error_type].http_status) == (category, status)
    assert (400 <= status < 500) == (category is Category.USER)
    cause = ApplicationError("seq_id 3 was already used", type=error_type)
    http = from_temporal(WorkflowUpdateFailedError(cause), "training run x")
    assert http.status_code == status and http.detail == "seq_id 3 was already used"
    assert failure_category(WorkflowUpdateFailedError(cause)) is category
    assert failure_category(WorkflowFailureError(cause=cause)) is category


def test_unlisted_failures_keep_their_old_answers():
    stray = WorkflowUpdateFailedError(ApplicationError("bad", type="SomethingElse"))
    assert from_temporal(stray, "x").status_code == 400 and failure_category(stray) is Category.SERVER
    assert failure_category(WorkflowFailureError(cause=RuntimeError("boom"))) is Category.SERVER
    assert from_temporal(RPCError("gone", RPCStatusCode.NOT_FOUND, b""), "run x").status_code == 404
    assert from_temporal(RPCError("bad", RPCStatusCode.INVALID_ARGUMENT, b""), "run x").status_code == 400
    assert from_temporal(RPCError("down", RPCStatusCode.UNAVAILABLE, b""), "run x").status_code == 503


@pytest.mark.parametrize("error_type", list(ErrorType), ids=str)
def test_the_enum_travels_as_the_plain_string_temporal_records(error_type):
    converter = DataConverter.default
    failure = Failure()
    converter.failure_converter.to_failure(ApplicationError("m", type=error_type), converter.payload_converter, failure)
    assert failure.application_failure_info.type == error_type.value
    back = converter.failure_converter.from_failure(failure, converter.payload_converter)
    assert isinstance(back, ApplicationError) and back.type == error_type.value and ErrorType(back.type) is error_type


def test_old_names_are_the_taxonomys_types():
    from tinkerflow.api.request_ids import BadRequestId
    from tinkerflow.common.checkpoints import CheckpointError, CheckpointNotFound
    from tinkerflow.common.store import StoreError
    from tinkerflow.workers.base_model import UnknownModelError
    from tinkerflow.workers.engine.types import InputError

    assert (InputError, UnknownModelError, BadRequestId, StoreError, CheckpointError, CheckpointNotFound) == (
        errors.InputError,
        errors.UnknownModelError,
        errors.BadRequestId,
        errors.StoreError,
        errors.CheckpointError,
        errors.CheckpointNotFound,
    )
    # Callers that caught the builtin bases keep working.
    assert issubclass(InputError, ValueError) and issubclass(CheckpointError, ValueError)
    assert issubclass(StoreError, RuntimeError) and issubclass(BadRequestId, ValueError)
