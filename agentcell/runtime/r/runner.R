# An R code context: one R process (Rscript), started by the agent (kernel_r.py).
#
# Requests come on fd 3 (the agent's socketpair) in kernel_r.py's encoding; answers go back there in
# the agent's framing (u32 header length, u32 payload length, JSON header, payload): `{"line": true}`
# frames carrying one E2B line, `{"done": true}` at a run's end, `{"warm": true}` once. R cannot open a
# socket by its descriptor number, so two `cat`s (deaf to SIGINT) carry the bytes between fd 3 and R's
# pipe connections; the process's fd 0 stays /dev/null, so a command run with system() reads nothing.
# fds 1 and 2 are the pipes the agent reads as stdout and stderr (R flushes the console at each write).
#
# A run evaluates the cell's top-level expressions one by one in .GlobalEnv, as IRkernel does: each
# visible value is a result with its printed text (the cell's last one is the main result), warnings
# go to stderr as "Warning message:", an error ends the cell as an error line named "ERROR" with
# R's message and the calls that led to it, and plots are PNG files of a device per run.

local({
  ctrl_in <- pipe("trap '' INT; exec cat <&3", "rb")
  ctrl_out <- pipe("trap '' INT; exec cat >&3", "wb")
  plot_dir <- file.path(tempdir(), "agentcell-plots")
  dir.create(plot_dir, showWarnings = FALSE)
  runs <- 1L  # as IPython's and IRkernel's: the number of the next run
  max_line <- 32 * 1024 * 1024  # as kernel.MAX_LINE
  eval_call <- quote(eval(expr, envir = .GlobalEnv))  # the call a top-level stop() reports: dropped

  # -- framing ----------------------------------------------------------------------------------------
  json_str <- function(s) {
    s <- enc2utf8(paste(s, collapse = "\n"))
    if (!validUTF8(s)) s <- iconv(s, "UTF-8", "UTF-8", sub = "\uFFFD")
    s <- gsub("\\", "\\\\", s, fixed = TRUE)
    s <- gsub("\"", "\\\"", s, fixed = TRUE)
    s <- gsub("\n", "\\n", s, fixed = TRUE)
    s <- gsub("\r", "\\r", s, fixed = TRUE)
    s <- gsub("\t", "\\t", s, fixed = TRUE)
    if (grepl("[\001-\037\177]", s, useBytes = TRUE)) {
      for (code in c(1:31, 127)) {
        ch <- rawToChar(as.raw(code))
        s <- gsub(ch, sprintf("\\u%04x", code), s, fixed = TRUE)
      }
    }
    paste0("\"", s, "\"")
  }
  json_obj <- function(fields) {  # fields: a named list of JSON texts
    keys <- vapply(names(fields), json_str, "", USE.NAMES = FALSE)
    paste0("{", paste0(keys, ":", unlist(fields), collapse = ","), "}")
  }
  u32 <- function(n) writeBin(as.integer(n), raw(), size = 4L, endian = "big")
  send_frame <- function(header, payload = raw()) suspendInterrupts({
    head <- charToRaw(header)
    writeBin(c(u32(length(head)), u32(length(payload)), head, payload), ctrl_out)
    flush(ctrl_out)
  })
  send_line <- function(fields, hold = FALSE) {
    data <- charToRaw(json_obj(fields))
    if (length(data) > max_line) {
      data <- charToRaw(json_obj(list(
        type = json_str("error"), name = json_str("OutputTooLarge"),
        value = json_str(sprintf("an output of %d bytes is over the %d MiB limit of one output; write it to a file and read it with files.read",
                                 length(data), max_line %/% (1024 * 1024))),
        traceback = json_str(""))))
    }
    send_frame(if (hold) "{\"line\":true,\"hold\":true}" else "{\"line\":true}", data)
  }
  send_error <- function(name, value, traceback) {
    send_line(list(type = json_str("error"), name = json_str(name), value = json_str(value),
                   traceback = json_str(traceback)))
  }
  read_int <- function() {
    n <- readBin(ctrl_in, "integer", n = 1L, size = 4L, endian = "big")
    if (length(n) == 0L) quit(save = "no", status = 0L)  # the agent closed the socket
    n
  }
  read_str <- function() {
    n <- read_int()
    if (n == 0L) return("")
    bytes <- readBin(ctrl_in, "raw", n = n)
    if (length(bytes) < n) quit(save = "no", status = 0L)
    s <- rawToChar(bytes)
    Encoding(s) <- "UTF-8"
    s
  }
  read_pairs <- function() {
    n <- read_int()
    keys <- character(n)
    values <- character(n)
    for (i in seq_len(n)) {
      keys[i] <- read_str()
      values[i] <- read_str()
    }
    structure(values, names = keys)
  }
  set_env <- function(env) if (length(env)) do.call(Sys.setenv, as.list(env))

  # -- base64 (base R has no encoder) -----------------------------------------------------------------
  b64_chars <- strsplit("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", "")[[1]]
  base64 <- function(bytes) {
    n <- length(bytes)
    pad <- (3L - n %% 3L) %% 3L
    m <- matrix(c(as.integer(bytes), integer(pad)), nrow = 3L)
    v <- m[1L, ] * 65536L + m[2L, ] * 256L + m[3L, ]
    out <- b64_chars[rbind(v %/% 262144L, (v %/% 4096L) %% 64L, (v %/% 64L) %% 64L, v %% 64L) + 1L]
    if (pad) out[(length(out) - pad + 1L):length(out)] <- "="
    paste(out, collapse = "")
  }

  # -- plots: a PNG device per run (IRkernel's size options, its defaults: 7 x 7 in at 120 dpi) --------
  devices <- integer()
  plot_device <- function(...) {
    width <- getOption("repr.plot.width", 7)
    height <- getOption("repr.plot.height", 7)
    res <- getOption("repr.plot.res", 120)
    file <- file.path(plot_dir, sprintf("plot-%03d-%%03d.png", length(devices) + 1L))
    grDevices::png(file, width = width, height = height, units = "in", res = res)
    devices <<- c(devices, grDevices::dev.cur())
    invisible()
  }
  send_plots <- function() {
    for (d in devices) if (d %in% grDevices::dev.list()) grDevices::dev.off(d)
    devices <<- integer()
    for (f in sort(list.files(plot_dir, pattern = "\\.png$", full.names = TRUE))) {
      size <- file.size(f)
      if (!is.na(size) && size > 0) {
        send_line(list(type = json_str("result"), text = json_str("plot without title"),
                       png = json_str(base64(readBin(f, "raw", n = size))),
                       is_main_result = "false"))
      }
      unlink(f)
    }
  }

  # -- running a cell -----------------------------------------------------------------------------------
  format_stack <- function(calls) {  # as IRkernel's: "1. f()", a call of several lines indented
    vapply(seq_along(calls), function(i) {
      text <- format(calls[[i]])
      prefix <- c(i, rep(strrep(" ", nchar(i)), length(text) - 1L))
      paste(paste0(prefix, ". ", text), collapse = "\n")
    }, "")
  }
  error_text <- function(e) {  # R's "Error in f(): msg", without the kernel's own eval() as the call
    if (identical(conditionCall(e), eval_call)) e$call <- NULL
    paste(sub("\n$", "", toString(e)), collapse = "")
  }
  print_value <- function(value) {  # as R's console prints a visible value (S4 objects with show())
    lines <- utils::capture.output(if (isS4(value)) methods::show(value) else print(value))
    paste(lines, collapse = "\n")
  }
  run_expr <- function(expr, is_last) {
    depth <- sys.nframe()
    stack <- character()
    out <- tryCatch(withCallingHandlers(
      withVisible(eval(expr, envir = .GlobalEnv)),
      warning = function(w) {
        call <- conditionCall(w)
        where <- if (is.null(call) || identical(call, eval_call)) "" else paste0("In ", deparse(call)[[1L]], ": ")
        cat(paste0("Warning message:\n", where, conditionMessage(w), "\n"), file = stderr())
        invokeRestart("muffleWarning")
      },
      error = function(e) {
        # the calls from the cell's code to the error: not the kernel's frames, not the handlers'
        calls <- sys.calls()
        n <- length(calls) - 1L  # this handler
        if (n > 0L && identical(calls[[n]][[1L]], quote(.handleSimpleError))) n <- n - 1L
        first <- depth + 1L
        while (first <= n && !identical(calls[[first]], eval_call)) first <- first + 1L
        while (first <= n && identical(calls[[first]], eval_call)) first <- first + 1L
        if (first <= n) stack <<- format_stack(calls[first:n])
      }), error = function(e) e)
    if (inherits(out, "condition")) {
      message <- error_text(out)
      send_error("ERROR", message, paste0(message, "\nTraceback:\n", paste(stack, collapse = "\n")))
      return(FALSE)
    }
    if (isTRUE(out$visible)) {
      text <- tryCatch(print_value(out$value), error = function(e) e)
      if (inherits(text, "condition")) {
        message <- error_text(text)
        send_error("ERROR", message, paste0(message, "\nTraceback:\n"))
        return(FALSE)
      }
      if (nzchar(text)) {
        send_line(list(type = json_str("result"), text = json_str(text),
                       is_main_result = if (is_last) "true" else "false"))
      }
    }
    TRUE
  }
  run_cell <- function(code) {
    exprs <- tryCatch(parse(text = code, keep.source = FALSE), error = function(e) e)
    if (inherits(exprs, "error")) {
      message <- paste0("Error in parse(text = code): ", conditionMessage(exprs))
      send_error("ERROR", message, paste0(message, "\nTraceback:\n"))
      return()
    }
    for (i in seq_along(exprs)) if (!run_expr(exprs[[i]], i == length(exprs))) break
  }
  serve_run <- function() {
    env <- read_pairs()
    code <- read_str()
    saved <- if (length(env)) Sys.getenv(names(env), unset = NA, names = TRUE) else character()
    set_env(env)
    send_line(list(type = json_str("number_of_executions"), execution_count = as.character(runs)), hold = TRUE)
    runs <<- runs + 1L
    old_device <- options(device = plot_device)
    tryCatch(run_cell(code), interrupt = function(i) {
      send_error("KeyboardInterrupt", "interrupted", "KeyboardInterrupt")
    })
    suspendInterrupts({
      options(old_device)
      tryCatch(send_plots(), error = function(e) send_error("ERROR", paste("plots:", error_text(e)), ""))
      for (k in names(saved)) if (is.na(saved[[k]])) Sys.unsetenv(k) else set_env(saved[k])
      send_frame("{\"done\":true}")
    })
  }

  options(warn = 1L)  # a warning not caught by a run's handler (there is none) is shown at once
  r <- getOption("repos")
  if (identical(r[["CRAN"]], "@CRAN@")) {  # Debian's Rprofile.site (the host's, not the sandbox's) sets it
    r[["CRAN"]] <- "https://cloud.r-project.org"
    options(repos = r)
  }
  send_frame("{\"warm\":true}")
  repeat {
    # An interrupt that came between runs was for a run that has ended: it is dropped here; one that
    # comes while the next request is being read is for that run, as in the Python kernel.
    tryCatch(Sys.sleep(0), interrupt = function(i) NULL)
    tryCatch({
      kind <- readBin(ctrl_in, "raw", n = 1L)
      if (length(kind) == 0L) quit(save = "no", status = 0L)
      if (kind == charToRaw("E")) set_env(read_pairs()) else serve_run()
    }, interrupt = function(i) NULL)
  }
})
