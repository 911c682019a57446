# The rc file of a bash code context (kernel_bash.py): an interactive bash without a terminal, so an
# interrupt (SIGINT) abandons the running cell and the shell, with its variables, functions and cwd,
# reads the next one. It answers the agent in its framing on fd 3 (u32 header length, u32 payload
# length, JSON header, payload; everything here is ASCII, so ${#s} counts bytes).
set +m +H
PS1='' PS2='' PS0='' PS4='+ '
unset PROMPT_COMMAND HISTFILE
set +o history
__agentcell_runs=1  # as IPython: the number of the next run
# printf -v, not $(...): no subshell (a fork) per frame
__agentcell_frame() {
  local h=${#1} p=${#2} prefix
  printf -v prefix '\\x%02x\\x%02x\\x%02x\\x%02x\\x%02x\\x%02x\\x%02x\\x%02x' \
    $((h >> 24 & 255)) $((h >> 16 & 255)) $((h >> 8 & 255)) $((h & 255)) \
    $((p >> 24 & 255)) $((p >> 16 & 255)) $((p >> 8 & 255)) $((p & 255))
  printf "$prefix%s%s" "$1" "$2" >&3
}
__agentcell_start() {
  __agentcell_frame '{"line":true,"hold":true}' "{\"type\":\"number_of_executions\",\"execution_count\":$__agentcell_runs}"
  __agentcell_runs=$((__agentcell_runs + 1))
}
# The cell's status: a non-zero exit status of its last command is an error, as in E2B's bash kernel.
__agentcell_done() {
  local rc=$?
  trap '' INT
  if ((rc != 0)); then
    __agentcell_frame '{"line":true}' "{\"type\":\"error\",\"name\":\"ExitCode\",\"value\":\"$rc\",\"traceback\":\"the last command exited with status $rc\"}"
  fi
  __agentcell_frame '{"done":true}' ''
  trap - INT
}
__agentcell_frame '{"warm":true}' ''
