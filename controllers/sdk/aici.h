/* Tiller controller SDK: freestanding C for wasm32 guests of the AICI ABI (AICI v0.0.x).
 *
 * Layers, bottom up (see controllers/ABI.md and controllers/README.md):
 *   1. raw host imports (aici_host_*, tiller_constraint_*) and the exports the runtime calls;
 *   2. libc bits (memory, allocator), blobs, logging, a JSON reader/writer, variable storage;
 *   3. the AiciCtrl callback struct: a controller fills an `aici_ctrl` and returns it from aici_controller();
 *   4. the token trie (AICI's serialized toktrie) and the walker computing a mask from a Recognizer;
 *   5. Recognizer <- StackRecognizer <- FunctionalRecognizer, and a byte-level regex FunctionalRecognizer;
 *   6. wrappers of the host-accelerated llguidance constraints;
 *   7. one generation under a JSON spec (constraint + stop strings + token limit), as constrain/declctrl use it;
 *   8. activation steering and concept readouts (Tiller's tiller_steer, tiller_readout, tiller_readout_info).
 * Everything lives in linear memory (plus the exported __stack_pointer), so the host can fork an instance by
 * copying its memory and mutable globals. */
#ifndef TILLER_AICI_H
#define TILLER_AICI_H

/* Freestanding headers that clang ships itself (no libc needed). */
#include <stddef.h>
#include <stdint.h>

/* ---------- 1. host imports ---------- */
#define AICI_IMPORT(name) __attribute__((import_module("env"), import_name(#name)))
AICI_IMPORT(aici_host_read_blob) uint32_t aici_host_read_blob(uint32_t blob, void *dst, uint32_t size);
AICI_IMPORT(aici_host_module_arg) uint32_t aici_host_module_arg(void);
AICI_IMPORT(aici_host_tokenize) uint32_t aici_host_tokenize(const void *src, uint32_t len);
AICI_IMPORT(aici_host_process_arg) uint32_t aici_host_process_arg(void);
AICI_IMPORT(aici_host_storage_cmd) uint32_t aici_host_storage_cmd(const void *cmd, uint32_t len);
AICI_IMPORT(aici_host_token_trie) uint32_t aici_host_token_trie(void);
AICI_IMPORT(aici_host_return_logit_bias) void aici_host_return_logit_bias(const uint32_t *bits);
AICI_IMPORT(aici_host_return_process_result) void aici_host_return_process_result(const void *res, uint32_t len);
AICI_IMPORT(aici_host_self_seq_id) uint32_t aici_host_self_seq_id(void);
AICI_IMPORT(aici_host_eos_token) uint32_t aici_host_eos_token(void);
AICI_IMPORT(aici_host_vocab_size) uint32_t aici_host_vocab_size(void);
AICI_IMPORT(aici_host_get_config) int32_t aici_host_get_config(const void *name, uint32_t len);
AICI_IMPORT(aici_host_stop) __attribute__((noreturn)) void aici_host_stop(void);
AICI_IMPORT(tiller_constraint_new) int32_t tiller_constraint_new(int32_t kind, const void *src, uint32_t len);
AICI_IMPORT(tiller_constraint_commit) int32_t tiller_constraint_commit(int32_t h, const uint32_t *toks, uint32_t n);
AICI_IMPORT(tiller_constraint_return_bias) int32_t tiller_constraint_return_bias(int32_t h);
AICI_IMPORT(tiller_constraint_mask) int32_t tiller_constraint_mask(int32_t h, uint32_t *dst);
AICI_IMPORT(tiller_constraint_ff_tokens) int32_t tiller_constraint_ff_tokens(int32_t h, uint32_t *dst, uint32_t cap);
AICI_IMPORT(tiller_constraint_rollback) int32_t tiller_constraint_rollback(int32_t h, uint32_t n);
AICI_IMPORT(tiller_constraint_free) void tiller_constraint_free(int32_t h);
AICI_IMPORT(tiller_steer) int32_t tiller_steer(const void *json, uint32_t len);
AICI_IMPORT(tiller_readout) int32_t tiller_readout(void *dst, uint32_t cap);
AICI_IMPORT(tiller_readout_info) int32_t tiller_readout_info(void *dst, uint32_t cap);

/* ---------- 2. libc bits, blobs, logs ---------- */
void *memcpy(void *dst, const void *src, size_t n);
void *memmove(void *dst, const void *src, size_t n);
void *memset(void *dst, int c, size_t n);
int memcmp(const void *a, const void *b, size_t n);
size_t strlen(const char *s);
void *malloc(size_t n);
void *calloc(size_t n, size_t size);
void *realloc(void *p, size_t n);
void free(void *p);
/* Copies a C string into fresh memory (n bytes, NUL-terminated). */
char *aici_strndup(const char *s, uint32_t n);

/* Reads a whole blob into fresh memory (NUL-terminated for convenience); *len gets its length. */
uint8_t *aici_read_blob(uint32_t blob, uint32_t *len);
/* Writes to stdout (fd 1 via WASI fd_write): the runtime returns it as the callback's `logs`. */
void aici_log(const char *s, uint32_t n);
void aici_logs(const char *s);             /* NUL-terminated */
void aici_log_u32(const char *label, uint32_t v);
/* Tokenizes bytes with the host tokenizer; returns fresh memory of *n tokens. */
uint32_t *aici_tokenize(const char *s, uint32_t len, uint32_t *n);
/* 1 iff the host capability ("fork", "backtrack", "ff_tokens") is on. */
int aici_config(const char *name);

/* Growable byte buffer. */
typedef struct { char *p; uint32_t n, cap; } aici_buf;
void aici_buf_put(aici_buf *b, const void *s, uint32_t n);
void aici_buf_puts(aici_buf *b, const char *s);
void aici_buf_putc(aici_buf *b, char c);
void aici_buf_u64(aici_buf *b, uint64_t v);
void aici_buf_i64(aici_buf *b, int64_t v);
void aici_buf_f64(aici_buf *b, double v);   /* a JSON number, 6 decimals (finite values only) */
void aici_buf_free(aici_buf *b);

/* ---------- JSON reader (spans into the source text; no DOM) ---------- */
typedef struct { const char *p; uint32_t n; } aici_json;   /* one JSON value, surrounding whitespace trimmed */
enum { AICI_J_INVALID = 0, AICI_J_OBJECT = 'o', AICI_J_ARRAY = 'a', AICI_J_STRING = 's', AICI_J_NUMBER = 'n',
       AICI_J_TRUE = 't', AICI_J_FALSE = 'f', AICI_J_NULL = 'z' };
/* Validates that src[0..n) is exactly one JSON value (nesting limit 64); 1 on success. */
int aici_json_parse(const char *src, uint32_t n, aici_json *out);
int aici_json_type(aici_json v);
/* Object member lookup (first match); 1 if found. */
int aici_json_get(aici_json obj, const char *key, aici_json *out);
/* Iteration over arrays (key NULL) and objects. Start with it = {0}. Returns 1 while there is an element. */
typedef struct { uint32_t pos; } aici_json_iter;
int aici_json_next(aici_json container, aici_json_iter *it, aici_json *key, aici_json *val);
uint32_t aici_json_len(aici_json container);   /* number of elements / members */
/* Integer value (no fraction/exponent allowed, fits int64); 1 on success. */
int aici_json_int(aici_json v, int64_t *out);
/* Any JSON number as a double; 1 on success. */
int aici_json_f64(aici_json v, double *out);
/* Unescaped string into fresh NUL-terminated memory (\uXXXX incl. surrogate pairs -> UTF-8); NULL if not a string. */
char *aici_json_str(aici_json v, uint32_t *len);
/* 1 iff v is a string whose unescaped value equals s. */
int aici_json_str_eq(aici_json v, const char *s);
/* JSON writer helpers. */
void aici_json_put_str(aici_buf *b, const char *s, uint32_t n);   /* quoted and escaped */
void aici_json_put_u32s(aici_buf *b, const uint32_t *v, uint32_t n);   /* [1,2,3] */
/* Reads a JSON array of u32 into fresh memory. Returns NULL (and *n = 0) if v is not such an array. */
uint32_t *aici_json_u32s(aici_json v, uint32_t *n);

/* ---------- variable storage (shared by all forks of a request; values are bytes) ---------- */
/* Returns fresh memory with the value (NUL-terminated) and its length, or NULL if the variable is missing. */
char *aici_var_get(const char *name, uint32_t *len, uint64_t *version);
/* Set / append; return the new version, or 0 on error. */
uint64_t aici_var_set(const char *name, const void *val, uint32_t len);
uint64_t aici_var_append(const char *name, const void *val, uint32_t len);

/* ---------- 3. callbacks ---------- */
typedef struct {
    uint32_t num_forks;        /* 1 = continue, 0 = stop, >1 = fork */
    int suspend;               /* skip this step */
    const uint32_t *ff_tokens; /* appended right away */
    uint32_t n_ff;
} aici_pre_result;

enum { AICI_MID_STOP = 0, AICI_MID_SAMPLE = 1, AICI_MID_SPLICE = 2 };
typedef struct {
    int kind;
    uint32_t backtrack;        /* SPLICE */
    const uint32_t *ff_tokens; /* SPLICE */
    uint32_t n_ff;
} aici_mid_result;

typedef struct {
    /* Any member may be NULL: defaults are no-op / continue / allow every token / don't stop. */
    void (*init_prompt)(const uint32_t *prompt, uint32_t n);
    aici_pre_result (*pre_process)(void);
    /* For AICI_MID_SAMPLE the controller hands over the mask during the call: aici_return_mask() or
     * aici_constraint_return_bias(); without one the SDK sends an all-allowed mask. */
    aici_mid_result (*mid_process)(const uint32_t *fork_group, uint32_t n);
    /* tokens appended since the last step after removing `backtrack` tokens; return 1 to stop. */
    int (*post_process)(const uint32_t *tokens, uint32_t n, uint32_t backtrack);
} aici_ctrl;

/* The controller defines this; called once from aici_create. */
const aici_ctrl *aici_controller(void);

/* Result builders. */
aici_pre_result aici_pre_continue(void);
aici_pre_result aici_pre_fork(uint32_t n);
aici_pre_result aici_pre_suspend(void);
aici_pre_result aici_pre_stop(void);
aici_mid_result aici_mid_stop(void);
aici_mid_result aici_mid_sample(void);
aici_mid_result aici_mid_splice(uint32_t backtrack, const uint32_t *ff, uint32_t n);
/* Hands a mask of aici_vocab_words() u32 words to the host for this mid_process. */
void aici_return_mask(const uint32_t *bits);

/* Sequence state kept by the SDK: prompt plus every post_process update (backtrack applied). */
extern uint32_t *aici_tokens;
extern uint32_t aici_n_tokens;
extern uint32_t aici_n_prompt;
uint32_t aici_vocab_size(void);
uint32_t aici_vocab_words(void);   /* ceil(vocab/32) */
uint32_t aici_eos(void);
/* Index of this sequence in a fork group, or -1. */
int aici_fork_index(const uint32_t *fork_group, uint32_t n);

/* ---------- 4. token trie ---------- */
/* Token bytes from the trie (NULL/0 for special tokens or out of range). Loads the trie on first use. */
const uint8_t *aici_token_bytes(uint32_t tok, uint32_t *len);
/* Appends the bytes of tokens to b. */
void aici_detokenize(aici_buf *b, const uint32_t *toks, uint32_t n);
/* Mask helpers (aici_vocab_words() words). */
uint32_t *aici_mask_new(void);     /* all zero */
static inline void aici_mask_allow(uint32_t *m, uint32_t t) { m[t >> 5] |= 1u << (t & 31); }
static inline int aici_mask_is_allowed(const uint32_t *m, uint32_t t) { return (m[t >> 5] >> (t & 31)) & 1; }
void aici_mask_allow_all(uint32_t *m);

/* ---------- 5. recognizers ---------- */
typedef struct aici_recognizer aici_recognizer;
typedef struct {
    void (*pop_bytes)(aici_recognizer *r, uint32_t n);
    int (*try_push_byte)(aici_recognizer *r, uint8_t b);   /* push if viable; 1 iff pushed */
    int (*special_allowed)(aici_recognizer *r, uint32_t tok);
    void (*collapse)(aici_recognizer *r);                   /* keep only the top state */
    void (*trie_finished)(aici_recognizer *r);
} aici_recognizer_vt;
struct aici_recognizer { const aici_recognizer_vt *vt; };
/* The AICI ABI's separate push_byte / byte_allowed, in terms of try_push_byte. */
static inline int aici_recognizer_byte_allowed(aici_recognizer *r, uint8_t b) {
    if (!r->vt->try_push_byte(r, b)) return 0;
    r->vt->pop_bytes(r, 1);
    return 1;
}
static inline int aici_recognizer_push_byte(aici_recognizer *r, uint8_t b) { return r->vt->try_push_byte(r, b); }

/* Walks the trie from the recognizer's current state: sets the bit of every token whose bytes are viable,
 * plus EOS if special_allowed(EOS). `mask` must be zeroed by the caller (aici_mask_new). */
void aici_compute_mask(aici_recognizer *r, uint32_t *mask);
/* Advances the recognizer by the bytes of a token and collapses; 0 if some byte was not viable (state kept). */
int aici_recognizer_push_token(aici_recognizer *r, uint32_t tok);

/* FunctionalRecognizer over u32 states: append returns 1 and sets *next iff the byte is viable (the AICI ABI's
 * byte_allowed + append in one call). */
typedef struct aici_functional aici_functional;
struct aici_functional {
    uint32_t (*initial)(aici_functional *f);
    int (*append)(aici_functional *f, uint32_t state, uint8_t b, uint32_t *next);
    int (*special_allowed)(aici_functional *f, uint32_t state, uint32_t tok);
};

/* StackRecognizer: turns a FunctionalRecognizer into a Recognizer with a state stack. */
#define AICI_STACK_DEPTH 300
typedef struct {
    aici_recognizer base;
    aici_functional *f;
    uint32_t sp;
    uint32_t stack[AICI_STACK_DEPTH];
} aici_stack_recognizer;
void aici_stack_recognizer_init(aici_stack_recognizer *s, aici_functional *f);
static inline uint32_t aici_stack_top(const aici_stack_recognizer *s) { return s->stack[s->sp]; }

/* Byte-level regex as a FunctionalRecognizer (lazy DFA over a Thompson NFA; implicit full match).
 * Syntax: literals, \-escapes (\n \t \r \f \v \0 \xHH \d \D \w \W \s \S and escaped metacharacters),
 * [classes] with ranges/negation/escapes, ., *, +, ?, {m}, {m,}, {m,n}, {,n}, |, (groups), (?:groups), leading ^ and
 * trailing $ (ignored: matching is always anchored). '.' is any byte except \n. Non-ASCII UTF-8 literals match
 * as byte sequences; a class lists bytes, so put multi-byte characters outside classes. */
typedef struct aici_regex aici_regex;
/* Compiles; NULL on syntax error (*err gets a static message). */
aici_regex *aici_regex_new(const char *pattern, uint32_t len, const char **err);
aici_functional *aici_regex_functional(aici_regex *rx);
uint32_t aici_regex_initial(aici_regex *rx);
/* 1 and *next iff the byte leads to a viable (non-dead) state. */
int aici_regex_step(aici_regex *rx, uint32_t state, uint8_t b, uint32_t *next);
int aici_regex_accepting(aici_regex *rx, uint32_t state);
/* 1 iff no byte is viable from state. */
int aici_regex_finished(aici_regex *rx, uint32_t state);
/* Whole-string match. */
int aici_regex_matches(aici_regex *rx, const char *s, uint32_t len);
/* Appends a regex matching exactly the literal bytes. */
void aici_regex_escape(aici_buf *b, const char *s, uint32_t len);

/* ---------- 6. host-accelerated constraints (llguidance in the host) ---------- */
enum { AICI_C_REGEX = 0, AICI_C_JSON_SCHEMA = 1, AICI_C_LARK = 2, AICI_C_YACC = 3 };
enum { AICI_C_OK = 0, AICI_C_FINISHED = 1 };   /* negative: error / rejected */
static inline int32_t aici_constraint_new(int32_t kind, const char *src, uint32_t len) {
    return tiller_constraint_new(kind, src, len);
}
static inline int32_t aici_constraint_commit(int32_t h, const uint32_t *toks, uint32_t n) {
    return tiller_constraint_commit(h, toks, n);
}
/* The tokens constraint h forces next (the one continuation its grammar allows, as the tokenizer splits it),
 * at most cap of them written at dst; returns their number (0: the next token is free). */
static inline uint32_t aici_constraint_ff_tokens(int32_t h, uint32_t *dst, uint32_t cap) {
    return (uint32_t)tiller_constraint_ff_tokens(h, dst, cap);
}
/* Forced tokens worth a Splice: a single one costs a step either way (sampled under a mask allowing only it). */
#define AICI_FF_MIN 2
/* Mask straight to the host for this mid_process (marks the SDK's mask as given). */
int32_t aici_constraint_return_bias(int32_t h);
/* Declares, until called again, that mid_process for this sequence alone (no fork this step) would only call
 * aici_constraint_return_bias(h) and sample when it returns AICI_C_OK: the host then computes that mask itself
 * and skips the call (it still calls mid_process whenever the constraint says anything else). h <= 0 withdraws
 * the declaration. ABI.md "Fast path", flags bit 1. Same as aici_declare_constraint(h, 1, 0). */
void aici_mid_from_constraint(int32_t h);
/* Declares, until the next declaration (which replaces it whole), what this sequence's callbacks would do with
 * constraint h (h <= 0 withdraws every declaration): mid AICI_DECLARE_MASK as aici_mid_from_constraint;
 * AICI_DECLARE_MASK_FF the same, except that where h forces AICI_FF_MIN tokens or more, mid_process would splice
 * them instead (aici_mid_splice(0, ...) of the first post_tokens + 1, read with aici_constraint_ff_tokens; ABI.md
 * "Fast path", flags bit 31); post_tokens
 * (at most 63): for that many tokens more, post_process with backtrack 0 and no EOS among its tokens would only
 * commit them to h and return 0 (continue) while the commit returns AICI_C_OK. The host may then commit such
 * tokens itself and answer for post_process; before it next calls this sequence it hands them over in one
 * post_process call with aici_post_committed set: they are already committed to h (do not commit them again).
 * ABI.md "Fast path", flags bits 2-7. */
enum { AICI_DECLARE_NONE = 0, AICI_DECLARE_MASK = 1, AICI_DECLARE_MASK_FF = 2 };
#define AICI_DECLARE_POST_MAX 63u   /* post_tokens beyond this are declared as this many (flags bits 2-7) */
void aici_declare_constraint(int32_t h, int mid, uint32_t post_tokens);
/* During post_process: 1 when its tokens were already committed to the declared constraint by the host. */
extern int aici_post_committed;
static inline int32_t aici_constraint_mask(int32_t h, uint32_t *dst) { return tiller_constraint_mask(h, dst); }
static inline int32_t aici_constraint_rollback(int32_t h, uint32_t n) { return tiller_constraint_rollback(h, n); }
static inline void aici_constraint_free(int32_t h) { tiller_constraint_free(h); }
/* Creates a host constraint from a JSON spec object: {"regex"|"rx": str} | {"json_schema": obj|str} |
 * {"grammar"|"lark": str, "syntax": "lark"|"yacc"} | {"yacc": str} | {"choices"|"options": [str...]}.
 * Returns the handle (> 0), 0 if the spec names no constraint, or < 0 with *err set. */
int32_t aici_constraint_from_json(aici_json spec, const char **err);

/* ---------- 7. one generation under a spec: constraint + stop strings + token limit ---------- */
typedef struct {
    int32_t constraint;   /* 0: unconstrained */
    char **stops;         /* stop strings (the text ends before the first one found) */
    uint32_t n_stops;
    uint32_t max_tokens;  /* 0: no limit */
    uint32_t start;       /* index in aici_tokens where the generation starts */
    uint32_t n_gen;       /* tokens generated */
    int done;
    int ended_by_eos;     /* the last generated token was EOS */
    int fast_forward;     /* splice the constraint's forced tokens instead of sampling them */
    uint32_t ff[64];      /* the last Splice's tokens */
} aici_gen;
/* Reads the spec (constraint keys above, "stop"/"stop_at": str|[str], "max_tokens": n, "fast_forward": bool);
 * 0 on error (*err). */
int aici_gen_init(aici_gen *g, aici_json spec, const char **err);
/* mid_process of the generation: with fast_forward, a Splice of the tokens the constraint forces when they are at
 * least AICI_FF_MIN (no more than max_tokens allows; none with stop strings, whose text each token must be
 * checked against); else the mask given and Sample, or Stop when the generation is over. */
aici_mid_result aici_gen_mid(aici_gen *g);
/* In post_process with the tokens of this step; returns 1 once the generation is over. */
int aici_gen_post(aici_gen *g, const uint32_t *toks, uint32_t n);
/* Declares the generation's constraint to the host while it goes on (aici_declare_constraint): its mask as
 * mid_process, and post_process's commits for as many tokens as max_tokens leaves (none with stop strings,
 * which need the text of every token). Call it after aici_gen_init and after each aici_gen_mid/_post; a
 * controller that does so must not do anything else in those callbacks while the generation goes on. */
void aici_gen_declare(const aici_gen *g);
/* Generated text (bytes up to the first stop string, without EOS), fresh memory. */
char *aici_gen_text(aici_gen *g, uint32_t *len);
void aici_gen_free(aici_gen *g);

/* ---------- 8. steering and readouts (ABI.md "Steering and readouts"; both from the first pre_process on) ------ */
/* Replaces this sequence's activation steering, from the next token fed on, with a JSON list of terms
 * [{"vector": "concept:<name>" | an id of the request's own steering, "scale", "layers"?, "positions"?}]
 * ("[]": none); 0, or -1 with the reason in the logs. */
static inline int32_t aici_steer(const char *json, uint32_t len) { return tiller_steer(json, len); }
/* The same with one readout concept's direction at its default layers (the readout layers); scale 0 clears. */
int32_t aici_steer_concept(const char *name, double scale);
/* The last fed position's readout, float32 [layers][concepts]: at most cap floats written at dst; returns how many
 * it holds (0: none yet). The first call (any callback, init_prompt included) asks for a readout at every step:
 * each callback after a step then sees the readout of the last position that step fed. */
static inline uint32_t aici_readout(float *dst, uint32_t cap) { return (uint32_t)tiller_readout(dst, cap * 4) / 4; }
/* The index of concept `name` in the readout, and its shape in *n_layers, *n_concepts; -1: not one of its concepts
 * (the reason in the logs), or not bound yet. */
int32_t aici_readout_concept(const char *name, uint32_t *n_layers, uint32_t *n_concepts);

#endif
