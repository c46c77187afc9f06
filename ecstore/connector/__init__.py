"""vLLM encoder-cache connector backed by ecstore.

Enable it with::

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "ECStoreConnector",
        "ec_role": "ec_both", "ec_connector_module_path": "ecstore.connector",
        "ec_connector_extra_config": {"config_file": "/etc/ec.yaml"}}'

Importing this package imports vLLM; ``import ecstore`` alone does not.
"""

from ecstore.connector.connector import ECStoreConnector
from ecstore.connector.metadata import ECStoreConnectorMetadata, ECStoreWorkerMetadata, LoadSpec
from ecstore.connector.stats import ECStoreConnectorStats, ECStorePromMetrics

__all__ = [
    "ECStoreConnector",
    "ECStoreConnectorMetadata",
    "ECStoreWorkerMetadata",
    "LoadSpec",
    "ECStoreConnectorStats",
    "ECStorePromMetrics",
]
