"""Agents (docs/agents.md, docs/design.md §6): what an episode's tools and an agent on the OpenAI
API run on. The types a plug-in writes against are :mod:`asyncrl.contract`'s.

- :mod:`asyncrl.agents.tools`: Python functions as tools (schemas from their signatures), run by a
  :class:`~asyncrl.agents.tools.ToolRegistry` with a timeout;
  :mod:`asyncrl.agents.tool_envs`: an episode's tool environment, Python functions or MCP servers.
- :mod:`asyncrl.agents.mcp_server`: a standard-library MCP server over stdio (fast to start, one per
  episode); :mod:`asyncrl.agents.demo_agent`: the agent demo's tool and reward on it.
- :mod:`asyncrl.agents.recording`: an agent written for ``openai.AsyncOpenAI`` as a workflow, each
  call recorded into one episode; :mod:`asyncrl.agents.proxy`: the same behind a loopback HTTP
  endpoint, for an agent that brings its own client.

A room below rollout/ (tests/test_import_graph.py): the worker's workflows call these tools.
"""
