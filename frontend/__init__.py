"""HTTP serving: OpenAI-compatible and SGLang-native endpoints over the Engine (ARCHITECTURE §5).

Entry points: `radixserve serve` (frontend.cli), `frontend.launch.run_server(ServerConfig)`,
`frontend.server.build_app(build_state(engine, config))` for embedding the app elsewhere.
"""
