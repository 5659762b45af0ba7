"""mTLS to Temporal (Temporal Cloud) from --temporal-tls-cert/-key/-ca."""

from __future__ import annotations

import pytest
from temporalio.service import TLSConfig

from tinkerflow.common.settings import Settings
from tinkerflow.common.temporal import tls_config


def test_temporal_tls_from_settings(tmp_path):
    assert tls_config(Settings(state_dir=tmp_path)) is False
    (tmp_path / "c.pem").write_bytes(b"CERT")
    (tmp_path / "k.pem").write_bytes(b"KEY")
    tls = tls_config(
        Settings(
            state_dir=tmp_path, temporal_tls_cert=str(tmp_path / "c.pem"), temporal_tls_key=str(tmp_path / "k.pem")
        )
    )
    assert isinstance(tls, TLSConfig) and (tls.client_cert, tls.client_private_key) == (b"CERT", b"KEY")
    assert tls.server_root_ca_cert is None
    with pytest.raises(ValueError, match="go together"):
        tls_config(Settings(state_dir=tmp_path, temporal_tls_cert=str(tmp_path / "c.pem")))
