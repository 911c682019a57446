"""`agentcell gateway`: one stateless front for many cells (`agentcell serve --cell-id`), docs/gateway.md.

Every sandbox id starts with its cell's id (server/cell.py), so any gateway replica routes any request
by the id alone; creates go to the less loaded of two random ready cells.
"""
