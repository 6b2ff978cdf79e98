/* SDK core: libc bits, allocator, blobs, logs, storage and the ABI exports driving an aici_ctrl. */
#include "aici.h"

#define EXPORT(name) __attribute__((export_name(#name)))

/* ---------- memory ---------- */
/* Built with -mbulk-memory: these builtins lower to memory.copy / memory.fill, not to calls. */
void *memcpy(void *dst, const void *src, size_t n) { return __builtin_memcpy(dst, src, n); }
void *memmove(void *dst, const void *src, size_t n) { return __builtin_memmove(dst, src, n); }
void *memset(void *dst, int c, size_t n) { return __builtin_memset(dst, c, n); }
int memcmp(const void *a, const void *b, size_t n) {
    const uint8_t *x = a, *y = b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i]) return x[i] < y[i] ? -1 : 1;
    return 0;
}
size_t strlen(const char *s) {
    size_t n = 0;
    while (s[n]) n++;
    return n;
}

/* Power-of-two size classes with one free list each; an 8-byte header keeps the class. All state is in
 * linear memory, so a forked copy of the memory is a consistent heap. */
extern uint8_t __heap_base;
#define NCLASS 28
static uint8_t *heap_top, *heap_end;
static void *free_lists[NCLASS];

static void *heap_take(uint32_t n) {
    if (!heap_top) {
        heap_top = (uint8_t *)(((uint32_t)&__heap_base + 15) & ~15u);
        heap_end = (uint8_t *)((uint32_t)__builtin_wasm_memory_size(0) << 16);
    }
    if ((uint32_t)(heap_end - heap_top) < n) {
        uint32_t pages = (n - (uint32_t)(heap_end - heap_top) + 65535) >> 16;
        if ((int32_t)__builtin_wasm_memory_grow(0, pages) < 0) return NULL;
        heap_end += pages << 16;
    }
    void *p = heap_top;
    heap_top += n;
    return p;
}

/* Every caller would have to check for NULL; a controller out of memory traps instead (the runtime ends
 * that sequence with the memory-limit error). */
__attribute__((noreturn)) static void out_of_memory(void) {
    static const char msg[] = "aici sdk: out of memory\n";
    aici_log(msg, sizeof msg - 1);
    __builtin_trap();
}

void *malloc(size_t n) {
    uint32_t c = 4;   /* 16 bytes including the header */
    if (n > (1u << (NCLASS - 1)) - 8) out_of_memory();
    while ((1u << c) < n + 8) c++;
    uint32_t *blk = free_lists[c];
    if (blk) free_lists[c] = *(void **)(blk + 2);
    else if (!(blk = heap_take(1u << c))) out_of_memory();
    blk[0] = c;
    return blk + 2;
}
void free(void *p) {
    if (!p) return;
    uint32_t *blk = (uint32_t *)p - 2;
    *(void **)p = free_lists[blk[0]];
    free_lists[blk[0]] = blk;
}
void *calloc(size_t n, size_t size) {
    if (size && n > 0xFFFFFFFFu / size) out_of_memory();
    void *p = malloc(n * size);
    memset(p, 0, n * size);
    return p;
}
void *realloc(void *p, size_t n) {
    if (!p) return malloc(n);
    uint32_t have = (1u << ((uint32_t *)p - 2)[0]) - 8;
    if (n <= have) return p;
    void *q = malloc(n);
    memcpy(q, p, have);
    free(p);
    return q;
}
char *aici_strndup(const char *s, uint32_t n) {
    char *d = malloc(n + 1);
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

/* ---------- buffers ---------- */
void aici_buf_put(aici_buf *b, const void *s, uint32_t n) {
    if (b->n + n + 1 > b->cap) {
        uint32_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1) cap *= 2;
        b->p = realloc(b->p, cap);
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
void aici_buf_puts(aici_buf *b, const char *s) { aici_buf_put(b, s, strlen(s)); }
void aici_buf_putc(aici_buf *b, char c) { aici_buf_put(b, &c, 1); }
void aici_buf_u64(aici_buf *b, uint64_t v) {
    char tmp[24];
    int i = 24;
    do { tmp[--i] = (char)('0' + v % 10); v /= 10; } while (v);
    aici_buf_put(b, tmp + i, 24 - i);
}
void aici_buf_i64(aici_buf *b, int64_t v) {
    if (v < 0) { aici_buf_putc(b, '-'); aici_buf_u64(b, (uint64_t)0 - (uint64_t)v); }
    else aici_buf_u64(b, (uint64_t)v);
}
void aici_buf_f64(aici_buf *b, double v) {
    if (v < 0) { aici_buf_putc(b, '-'); v = -v; }
    if (v > 1e18) v = 1e18;
    uint64_t whole = (uint64_t)v, frac = (uint64_t)((v - (double)whole) * 1e6 + 0.5);
    if (frac >= 1000000) { whole++; frac -= 1000000; }
    char digits[7] = {'.'};
    for (int i = 6; i > 0; i--, frac /= 10) digits[i] = (char)('0' + frac % 10);
    aici_buf_u64(b, whole);
    aici_buf_put(b, digits, 7);
}
void aici_buf_free(aici_buf *b) { free(b->p); b->p = NULL; b->n = b->cap = 0; }

/* ---------- blobs, logs, host helpers ---------- */
uint8_t *aici_read_blob(uint32_t blob, uint32_t *len) {
    uint8_t pre[256];
    uint32_t n = aici_host_read_blob(blob, pre, sizeof pre);
    uint8_t *out = malloc(n + 1);
    if (n <= sizeof pre) memcpy(out, pre, n);
    else aici_host_read_blob(blob, out, n);
    out[n] = 0;
    if (len) *len = n;
    return out;
}

typedef struct { const void *buf; uint32_t len; } wasi_iovec;
__attribute__((import_module("wasi_snapshot_preview1"), import_name("fd_write")))
int32_t wasi_fd_write(int32_t fd, const wasi_iovec *iov, int32_t n, uint32_t *written);

void aici_log(const char *s, uint32_t n) {
    wasi_iovec v = {s, n};
    uint32_t w;
    wasi_fd_write(1, &v, 1, &w);
}
void aici_logs(const char *s) { aici_log(s, strlen(s)); }
void aici_log_u32(const char *label, uint32_t v) {
    aici_buf b = {0};
    aici_buf_puts(&b, label);
    aici_buf_u64(&b, v);
    aici_buf_putc(&b, '\n');
    aici_log(b.p, b.n);
    aici_buf_free(&b);
}

uint32_t *aici_tokenize(const char *s, uint32_t len, uint32_t *n) {
    uint32_t bytes;
    uint32_t *toks = (uint32_t *)aici_read_blob(aici_host_tokenize(s, len), &bytes);
    *n = bytes / 4;
    return toks;
}
int aici_config(const char *name) { return aici_host_get_config(name, strlen(name)) == 1; }

static uint32_t vocab_size_cache, eos_cache = 0xFFFFFFFFu;
uint32_t aici_vocab_size(void) {
    if (!vocab_size_cache) vocab_size_cache = aici_host_vocab_size();
    return vocab_size_cache;
}
uint32_t aici_vocab_words(void) { return (aici_vocab_size() + 31) / 32; }
uint32_t aici_eos(void) {
    if (eos_cache == 0xFFFFFFFFu) eos_cache = aici_host_eos_token();
    return eos_cache;
}
int aici_fork_index(const uint32_t *fork_group, uint32_t n) {
    uint32_t me = aici_host_self_seq_id();
    for (uint32_t i = 0; i < n; i++)
        if (fork_group[i] == me) return (int)i;
    return -1;
}

/* ---------- variable storage ---------- */
static const char HEX[] = "0123456789abcdef";

static uint8_t *storage_cmd(aici_buf *cmd, aici_json *resp) {
    uint32_t n;
    uint8_t *raw = aici_read_blob(aici_host_storage_cmd(cmd->p, cmd->n), &n);
    aici_buf_free(cmd);
    if (!aici_json_parse((const char *)raw, n, resp)) resp->n = 0;
    return raw;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

char *aici_var_get(const char *name, uint32_t *len, uint64_t *version) {
    aici_buf cmd = {0};
    aici_buf_puts(&cmd, "{\"ReadVar\":{\"name\":");
    aici_json_put_str(&cmd, name, strlen(name));
    aici_buf_puts(&cmd, "}}");
    aici_json resp, body, val, ver;
    uint8_t *raw = storage_cmd(&cmd, &resp);
    char *out = NULL;
    if (resp.n && aici_json_get(resp, "ReadVar", &body) && aici_json_get(body, "value", &val)) {
        uint32_t hn;
        char *hex = aici_json_str(val, &hn);
        if (hex) {
            out = malloc(hn / 2 + 1);
            for (uint32_t i = 0; i + 1 < hn; i += 2)
                out[i / 2] = (char)(hexval(hex[i]) << 4 | hexval(hex[i + 1]));
            out[hn / 2] = 0;
            if (len) *len = hn / 2;
            free(hex);
        }
        int64_t v;
        if (version && aici_json_get(body, "version", &ver) && aici_json_int(ver, &v)) *version = (uint64_t)v;
    }
    free(raw);
    return out;
}

static uint64_t var_write(const char *name, const void *val, uint32_t len, const char *op) {
    aici_buf cmd = {0};
    aici_buf_puts(&cmd, "{\"WriteVar\":{\"name\":");
    aici_json_put_str(&cmd, name, strlen(name));
    aici_buf_puts(&cmd, ",\"value\":\"");
    const uint8_t *v = val;
    for (uint32_t i = 0; i < len; i++) {
        char h[2] = {HEX[v[i] >> 4], HEX[v[i] & 15]};
        aici_buf_put(&cmd, h, 2);
    }
    aici_buf_puts(&cmd, "\",\"op\":\"");
    aici_buf_puts(&cmd, op);
    aici_buf_puts(&cmd, "\",\"when_version_is\":null}}");
    aici_json resp, body, ver;
    uint8_t *raw = storage_cmd(&cmd, &resp);
    int64_t version = 0;
    if (!(resp.n && aici_json_get(resp, "WriteVar", &body) && aici_json_get(body, "version", &ver) &&
          aici_json_int(ver, &version)))
        version = 0;
    free(raw);
    return (uint64_t)version;
}
uint64_t aici_var_set(const char *name, const void *val, uint32_t len) { return var_write(name, val, len, "Set"); }
uint64_t aici_var_append(const char *name, const void *val, uint32_t len) {
    return var_write(name, val, len, "Append");
}

/* ---------- callbacks and exports ---------- */
uint32_t *aici_tokens;
uint32_t aici_n_tokens, aici_n_prompt;
static uint32_t tokens_cap;
static const aici_ctrl *ctrl;
static int mask_given;

aici_pre_result aici_pre_continue(void) { return (aici_pre_result){1, 0, NULL, 0}; }
aici_pre_result aici_pre_fork(uint32_t n) { return (aici_pre_result){n, 0, NULL, 0}; }
aici_pre_result aici_pre_suspend(void) { return (aici_pre_result){1, 1, NULL, 0}; }
aici_pre_result aici_pre_stop(void) { return (aici_pre_result){0, 0, NULL, 0}; }
aici_mid_result aici_mid_stop(void) { return (aici_mid_result){AICI_MID_STOP, 0, NULL, 0}; }
aici_mid_result aici_mid_sample(void) { return (aici_mid_result){AICI_MID_SAMPLE, 0, NULL, 0}; }
aici_mid_result aici_mid_splice(uint32_t backtrack, const uint32_t *ff, uint32_t n) {
    return (aici_mid_result){AICI_MID_SPLICE, backtrack, ff, n};
}
void aici_return_mask(const uint32_t *bits) {
    aici_host_return_logit_bias(bits);
    mask_given = 1;
}
int32_t aici_constraint_return_bias(int32_t h) {
    int32_t r = tiller_constraint_return_bias(h);
    if (r >= 0) mask_given = 1;
    return r;
}

static void tokens_push(const uint32_t *t, uint32_t n) {
    if (aici_n_tokens + n > tokens_cap) {
        uint32_t cap = tokens_cap ? tokens_cap : 256;
        while (cap < aici_n_tokens + n) cap *= 2;
        aici_tokens = realloc(aici_tokens, cap * 4);
        tokens_cap = cap;
    }
    memcpy(aici_tokens + aici_n_tokens, t, n * 4);
    aici_n_tokens += n;
}

/* The I/O area of ABI.md's fast path: a host that knows it writes each callback's argument here (arg_len) and
 * offers to read the result from here (result_len = NONE before the call), which saves two host calls per
 * callback. Anything longer than TILLER_IO_CAP, or a host that never touches the area, takes the blob calls. */
#define TILLER_IO_CAP 4096
#define TILLER_IO_NONE 0xFFFFFFFFu
#define TILLER_IO_PRE_DEFAULT 1u   /* flags: pre_process always continues, with no effects: the host may skip it */
#define TILLER_IO_MID_CONSTRAINT 2u /* flags: mid_process alone is the mask of constraint flags >> 8 (see below) */
#define TILLER_IO_POST_SHIFT 2      /* flags bits 2-7: tokens whose post_process the host may answer (see below) */
#define TILLER_IO_MID_FF 0x80000000u /* flags: with MID_CONSTRAINT, mid_process splices the forced tokens (see below) */
#define TILLER_IO_HANDLE_LIMIT (1 << 23) /* flags bits 8-30: the handle */
static struct {
    uint32_t cap, flags, arg_len, result_len;
    uint8_t data[TILLER_IO_CAP];
} io;

EXPORT(tiller_io) uint32_t tiller_io(void) { return (uint32_t)&io; }

void aici_declare_constraint(int32_t h, int mid, uint32_t post_tokens) {
    io.flags &= TILLER_IO_PRE_DEFAULT;
    if (h <= 0 || h >= TILLER_IO_HANDLE_LIMIT) return;
    if (post_tokens > AICI_DECLARE_POST_MAX) post_tokens = AICI_DECLARE_POST_MAX;
    io.flags |= (mid ? TILLER_IO_MID_CONSTRAINT : 0) | (mid == AICI_DECLARE_MASK_FF ? TILLER_IO_MID_FF : 0) |
                post_tokens << TILLER_IO_POST_SHIFT | (uint32_t)h << 8;
}

void aici_mid_from_constraint(int32_t h) { aici_declare_constraint(h, AICI_DECLARE_MASK, 0); }

int aici_post_committed;

static void reply(aici_buf *b) {
    if (io.result_len == TILLER_IO_NONE && b->n <= TILLER_IO_CAP) {
        memcpy(io.data, b->p, b->n);
        io.result_len = b->n;
    } else {
        aici_host_return_process_result(b->p, b->n);
    }
    aici_buf_free(b);
}

/* Parses the process arg; returns the bytes to free afterwards (NULL when it came in the I/O area). The blob id
 * is fixed by the ABI, so it is asked for once. */
static uint32_t process_arg_blob;
static uint8_t *process_arg(aici_json *arg) {
    uint32_t n = io.arg_len;
    uint8_t *raw = NULL;
    const char *src = (const char *)io.data;
    if (n > TILLER_IO_CAP) {
        if (!process_arg_blob) process_arg_blob = aici_host_process_arg();
        raw = aici_read_blob(process_arg_blob, &n);
        src = (const char *)raw;
    }
    if (!aici_json_parse(src, n, arg)) {
        aici_logs("aici sdk: process arg is not valid JSON\n");
        aici_host_stop();
    }
    return raw;
}

EXPORT(aici_init) void aici_init(void) {
    io.cap = TILLER_IO_CAP;
    io.arg_len = TILLER_IO_NONE;
}

EXPORT(aici_create) uint32_t aici_create(void) {
    ctrl = aici_controller();
    if (!ctrl->pre_process) io.flags |= TILLER_IO_PRE_DEFAULT;
    return 1;
}

EXPORT(aici_init_prompt) void aici_init_prompt(uint32_t h) {
    (void)h;
    aici_json arg, prompt;
    uint8_t *raw = process_arg(&arg);
    uint32_t n = 0;
    uint32_t *toks = aici_json_get(arg, "prompt", &prompt) ? aici_json_u32s(prompt, &n) : NULL;
    aici_n_tokens = 0;
    tokens_push(toks, n);
    aici_n_prompt = n;
    if (ctrl->init_prompt) ctrl->init_prompt(toks, n);
    free(toks);
    free(raw);
    aici_buf b = {0};
    aici_buf_puts(&b, "{}");
    reply(&b);
}

EXPORT(aici_pre_process) void aici_pre_process(uint32_t h) {
    (void)h;   /* its process arg is always {}: not read */
    aici_pre_result r = ctrl->pre_process ? ctrl->pre_process() : aici_pre_continue();
    aici_buf b = {0};
    aici_buf_puts(&b, "{\"num_forks\":");
    aici_buf_u64(&b, r.num_forks);
    aici_buf_puts(&b, r.suspend ? ",\"suspend\":true,\"ff_tokens\":" : ",\"suspend\":false,\"ff_tokens\":");
    aici_json_put_u32s(&b, r.ff_tokens, r.n_ff);
    aici_buf_putc(&b, '}');
    reply(&b);
}

EXPORT(aici_mid_process) void aici_mid_process(uint32_t h) {
    (void)h;
    aici_json arg, fg;
    uint8_t *raw = process_arg(&arg);
    uint32_t n = 0;
    uint32_t *group = aici_json_get(arg, "fork_group", &fg) ? aici_json_u32s(fg, &n) : NULL;
    mask_given = 0;
    aici_mid_result r = ctrl->mid_process ? ctrl->mid_process(group, n) : aici_mid_sample();
    free(group);
    free(raw);
    aici_buf b = {0};
    if (r.kind == AICI_MID_SAMPLE) {
        if (!mask_given) {
            static uint32_t *all_allowed;
            if (!all_allowed) {
                all_allowed = aici_mask_new();
                aici_mask_allow_all(all_allowed);
            }
            aici_host_return_logit_bias(all_allowed);
        }
        aici_buf_puts(&b, "{\"SampleWithBias\":{}}");
    } else if (r.kind == AICI_MID_SPLICE) {
        aici_buf_puts(&b, "{\"Splice\":{\"backtrack\":");
        aici_buf_u64(&b, r.backtrack);
        aici_buf_puts(&b, ",\"ff_tokens\":");
        aici_json_put_u32s(&b, r.ff_tokens, r.n_ff);
        aici_buf_puts(&b, "}}");
    } else {
        aici_buf_puts(&b, "\"Stop\"");
    }
    reply(&b);
}

EXPORT(aici_post_process) void aici_post_process(uint32_t h) {
    (void)h;
    aici_json arg, v;
    uint8_t *raw = process_arg(&arg);
    uint32_t n = 0;
    int64_t bt = 0;
    uint32_t *toks = aici_json_get(arg, "tokens", &v) ? aici_json_u32s(v, &n) : NULL;
    if (aici_json_get(arg, "backtrack", &v)) aici_json_int(v, &bt);
    if (bt < 0) bt = 0;
    aici_post_committed = aici_json_get(arg, "committed", &v) && aici_json_type(v) == AICI_J_TRUE;
    aici_n_tokens = (uint32_t)bt > aici_n_tokens ? 0 : aici_n_tokens - (uint32_t)bt;
    tokens_push(toks, n);
    int stop = ctrl->post_process ? ctrl->post_process(toks, n, (uint32_t)bt) : 0;
    aici_post_committed = 0;
    free(toks);
    free(raw);
    aici_buf b = {0};
    aici_buf_puts(&b, stop ? "{\"stop\":true}" : "{\"stop\":false}");
    reply(&b);
}

EXPORT(aici_panic) void aici_panic(void) {}
