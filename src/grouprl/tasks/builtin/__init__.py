"""The tasks grouprl ships: `arithmetic` (the default), `lookup` (a tool to call) and `code`
(one-line functions judged in the sandbox), each with its bundled base policy
(`grouprl.models.builtin`)."""
