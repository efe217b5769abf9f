"""ZeroMQ RPC for treadle services: ROUTER server, DEALER client, CURVE keys.

Typical use::

    server = RpcServer(name="rewards", handlers={"score": score})   # async def score(msg, ctx)
    endpoint = await server.start()                                   # tcp://127.0.0.1:<port>
    async with RpcClient(endpoint) as client:
        result = await client.call("score", RewardRequest(queries=[...]), timeout=30)
    await server.close(grace_s=5)

Messages are ``treadle.common.codec`` frames; failures travel as ``records.Error`` and come
back as the exceptions in ``treadle.common.errors``.
"""

from treadle.common.rpc.client import RpcClient
from treadle.common.rpc.curve import (
    ClientCurve,
    ServerCurve,
    generate_keys,
    load_client_keys,
    load_server_keys,
)
from treadle.common.rpc.server import CallHandler, Handler, RequestContext, RpcServer, StreamHandler
from treadle.common.rpc.sync import LoopThread, ServerThread, SyncRpcClient
from treadle.common.rpc.transport import InsecureEndpoint

__all__ = [
    "CallHandler", "ClientCurve", "Handler", "InsecureEndpoint", "LoopThread", "RequestContext",
    "RpcClient", "RpcServer", "ServerCurve", "ServerThread", "StreamHandler", "SyncRpcClient",
    "generate_keys", "load_client_keys", "load_server_keys",
]
