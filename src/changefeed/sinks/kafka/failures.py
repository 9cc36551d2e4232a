"""librdkafka's errors as changefeed's typed ones: which come back on a rerun, which need a fix."""
from __future__ import annotations

from functools import cache

from changefeed.errors import AuthenticationFailed, ChangefeedError, SinkError, TransientError
from changefeed.sinks.kafka.options import KafkaOptions


class ProducerFenced(TransientError):
    """A newer producer of the feed's transactional id ended this one: another runner's, or a
    leftover task of this runner's own stopped query."""


def kafka_error(e: BaseException, doing: str, opts: KafkaOptions) -> ChangefeedError:
    """A librdkafka error as our typed error: transient ones (timeouts, brokers down) come back on a rerun."""
    from confluent_kafka import KafkaError, KafkaException

    err = e.args[0] if isinstance(e, KafkaException) and e.args and isinstance(e.args[0], KafkaError) else None
    if err is None:
        return e if isinstance(e, ChangefeedError) else SinkError(f"Kafka sink, {doing}: {e!r}", "see the log")
    what = f"Kafka {opts.bootstrap}, {doing}: {err.name()} ({err.str()})"
    code = err.code()
    if code in (KafkaError.SASL_AUTHENTICATION_FAILED, KafkaError._AUTHENTICATION):
        return AuthenticationFailed(what, "check sasl.username / sasl.password / the TLS settings of the --sink URI")
    if code in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                KafkaError.CLUSTER_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED):
        return SinkError(what, "grant the sink's principal Write/Describe on its topics and the progress topic, "
                               "and Write on its transactional id changefeed-FEED")
    if code in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE):
        return SinkError(what, "raise message.max.bytes (producer) and max.message.bytes (topic), or use --format "
                               "json without --diff for smaller messages")
    if code in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH):
        return ProducerFenced(what, "another producer took over the transactional id changefeed-FEED (a second "
                                    "runner of this feed, or a leftover task); run the feed again")
    if code == KafkaError._INVALID_ARG:  # librdkafka refused the settings (run's checks name them first)
        return opts.refused(err.str())
    if err.fatal() or not (err.retriable() or code in _transient_codes()):
        return SinkError(what, "see the broker's answer above; the feed resumes from its checkpoint when run again")
    return TransientError(what, "the broker may be down or slow; the feed resumes from its checkpoint when run "
                                "again (raise timeout= for slow clusters)")


@cache
def _transient_codes() -> tuple[int, ...]:
    from confluent_kafka import KafkaError

    return (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT, KafkaError._MSG_TIMED_OUT,
            KafkaError.REQUEST_TIMED_OUT, KafkaError.NOT_ENOUGH_REPLICAS, KafkaError.LEADER_NOT_AVAILABLE,
            KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError._RESOLVE)
