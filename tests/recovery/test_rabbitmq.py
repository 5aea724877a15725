"""RabbitMQ as the broker: a worker consuming from it executes a posted step.

The other recovery tests use Redis or the embedded broker; this one shows that
CELERY_BROKER_URL=amqp://… works end to end with a real worker process.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import pytest
from celery import Celery

from executor.common import dispatch
from executor.ledger.records import Step
from executor.ledger.states import State
from tests.support.cluster import Cluster

AMQP_URL = os.environ.get("STEPWARD_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672//")

pytestmark = pytest.mark.django_db(transaction=True)


def rabbitmq_answers() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=2).close()
    except OSError:
        return False
    return True


@pytest.fixture
def amqp() -> str:
    if not rabbitmq_answers():
        if os.environ.get("STEPWARD_REQUIRE_RABBITMQ") == "1":
            pytest.fail("RabbitMQ is required (STEPWARD_REQUIRE_RABBITMQ=1) but does not answer")
        pytest.skip("no RabbitMQ at 127.0.0.1:5672")
    return AMQP_URL


def test_a_step_published_to_rabbitmq_is_executed_by_a_worker_consuming_it(
    amqp: str, cluster: Cluster, post: Callable[..., Step]
) -> None:
    worker = cluster.worker().start(CELERY_BROKER_URL=amqp, EXECUTOR_DRAIN_LIMIT="0")
    with dispatch.publishing(dispatch.dropping_publisher):
        step = post("echo", {"via": "rabbitmq"})
    # Celery lets a CELERY_BROKER_URL in the environment (Redis, in CI's PostgreSQL pass)
    # override an app's broker, so the connection to RabbitMQ is named explicitly. Not
    # the current app: the shared tasks would publish through it in every later test.
    publisher = Celery(broker=amqp, set_as_current=False)
    try:
        with publisher.connection_for_write(amqp) as connection:
            publisher.send_task(
                "stepward.execute_step",
                args=[str(step.pk)],
                queue=cluster.queue,
                connection=connection,
            )

        done = cluster.wait_settled(step)

        assert done.state == State.COMPLETED, cluster.diagnose()
        assert done.result == {"via": "rabbitmq"}
        cluster.wait_task_outcome(worker, "completed")
        assert "amqp://" in worker.log()
    finally:
        with publisher.connection_for_write(amqp) as connection:
            connection.default_channel.queue_delete(cluster.queue)
