/* The delayer of one spread-testbed host (benchmarks/spreadnet.py compiles and starts it, one per
 * host namespace): packets the host's INPUT chain queues with NFQUEUE (queue q = the source host's
 * index) are held for the pair's one-way delay +- jitter, counted from the kernel's arrival stamp,
 * never released before an earlier packet of the same queue (a flow keeps its order, as netem with
 * a rate), then accepted with one batch verdict per queue. Metadata only (no payload is copied),
 * fail-open and a long queue, so nothing is dropped here; ids never seen are counted as missed.
 *
 * While packets stream it wakes once per tick and handles every packet that arrived and every
 * release due within half a tick (so releases land within +- half a tick of their due time); idle,
 * it sleeps until the next release. Plain netlink (linux headers only, no libnetfilter_queue).
 *
 * stdin, one command per line, one JSON line answered on stdout:
 *   queue Q DELAY_S JITTER_S   bind queue Q (or change its hold)
 *   stats                      counters
 * It ends at EOF on stdin. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define TICK_NS 500000LL
#define MAX_QUEUES 256
#define QUEUE_MAXLEN 131072
#define BUF_SIZE (1 << 16)

struct held { int64_t release_ns; uint32_t id; };
struct queue {
    int bound;
    int64_t delay_ns, jitter_ns, last_release_ns;
    uint32_t next_id;
    int have_id;
    struct held *items;
    size_t head, tail, cap;
};

static struct queue queues[MAX_QUEUES];
static int nl;
static long long packets, missed, unstamped, wakes, held_max, late_over_1ms;
static double late_ms_max, late_ms_sum;
static const char *priority = "normal (no CAP_SYS_NICE)";

static void die(const char *what) { perror(what); exit(1); }

static int64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void push(struct queue *q, int64_t release_ns, uint32_t id) {
    if (q->tail == q->cap) {
        if (q->head > 0) {  /* compact before growing */
            memmove(q->items, q->items + q->head, (q->tail - q->head) * sizeof *q->items);
            q->tail -= q->head;
            q->head = 0;
        }
        if (q->tail == q->cap) {
            q->cap = q->cap ? 2 * q->cap : 1024;
            q->items = realloc(q->items, q->cap * sizeof *q->items);
            if (!q->items) die("realloc");
        }
    }
    q->items[q->tail++] = (struct held){release_ns, id};
    if ((long long)(q->tail - q->head) > held_max) held_max = q->tail - q->head;
}

static size_t put_attr(char *at, uint16_t type, const void *data, uint16_t len) {
    struct nlattr *attr = (struct nlattr *)at;
    attr->nla_len = NLA_HDRLEN + len;
    attr->nla_type = type;
    memcpy(at + NLA_HDRLEN, data, len);
    memset(at + NLA_HDRLEN + len, 0, NLA_ALIGN(attr->nla_len) - attr->nla_len);
    return NLA_ALIGN(attr->nla_len);
}

static size_t put_header(char *at, uint16_t kind, uint16_t flags, uint16_t queue) {
    struct nlmsghdr *nlh = (struct nlmsghdr *)at;
    memset(at, 0, NLMSG_HDRLEN + sizeof(struct nfgenmsg));
    nlh->nlmsg_type = (NFNL_SUBSYS_QUEUE << 8) | kind;
    nlh->nlmsg_flags = flags;
    nlh->nlmsg_seq = queue;
    struct nfgenmsg *gen = NLMSG_DATA(nlh);
    gen->nfgen_family = AF_UNSPEC;
    gen->version = NFNETLINK_V0;
    gen->res_id = htons(queue);
    return NLMSG_HDRLEN + NLMSG_ALIGN(sizeof(struct nfgenmsg));
}

static void bind_queue(int num) {
    char msg[256];
    size_t len = put_header(msg, NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, num);
    struct nfqnl_msg_config_cmd cmd = {.command = NFQNL_CFG_CMD_BIND};
    struct nfqnl_msg_config_params params = {.copy_range = 0, .copy_mode = NFQNL_COPY_META};
    uint32_t maxlen = htonl(QUEUE_MAXLEN), flags = htonl(NFQA_CFG_F_FAIL_OPEN);
    len += put_attr(msg + len, NFQA_CFG_CMD, &cmd, sizeof cmd);
    len += put_attr(msg + len, NFQA_CFG_PARAMS, &params, sizeof params);
    len += put_attr(msg + len, NFQA_CFG_QUEUE_MAXLEN, &maxlen, sizeof maxlen);
    len += put_attr(msg + len, NFQA_CFG_MASK, &flags, sizeof flags);
    len += put_attr(msg + len, NFQA_CFG_FLAGS, &flags, sizeof flags);
    ((struct nlmsghdr *)msg)->nlmsg_len = len;
    if (send(nl, msg, len, 0) < 0) die("send config");
    /* its ack (or error) comes back among the packets and is checked there */
}

/* Queues every packet the kernel has handed over; returns how many. */
static long read_packets(void) {
    static char buf[BUF_SIZE];
    long count = 0;
    int64_t read_at = clock_ns(CLOCK_MONOTONIC);
    int64_t wall_offset = clock_ns(CLOCK_REALTIME) - read_at;
    for (;;) {
        ssize_t size = recv(nl, buf, sizeof buf, MSG_DONTWAIT);
        if (size < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            if (errno == EINTR) continue;
            die("recv");
        }
        int len = (int)size;
        for (struct nlmsghdr *nlh = (struct nlmsghdr *)buf; NLMSG_OK(nlh, len); nlh = NLMSG_NEXT(nlh, len)) {
            if (nlh->nlmsg_type == NLMSG_ERROR) {
                struct nlmsgerr *err = NLMSG_DATA(nlh);
                if (err->error) {
                    fprintf(stderr, "nfqueue config refused: %s\n", strerror(-err->error));
                    exit(1);
                }
                continue;
            }
            if (nlh->nlmsg_type != ((NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET)) continue;
            struct nfgenmsg *gen = NLMSG_DATA(nlh);
            int num = ntohs(gen->res_id);
            uint32_t id = 0;
            int64_t arrived = read_at;
            int stamped = 0;
            struct nlattr *attr = (struct nlattr *)((char *)gen + NLMSG_ALIGN(sizeof *gen));
            int rem = (int)nlh->nlmsg_len - NLMSG_LENGTH(sizeof *gen);
            while (rem >= (int)sizeof *attr && attr->nla_len >= sizeof *attr && attr->nla_len <= rem) {
                void *data = (char *)attr + NLA_HDRLEN;
                switch (attr->nla_type & NLA_TYPE_MASK) {
                case NFQA_PACKET_HDR:
                    id = ntohl(((struct nfqnl_msg_packet_hdr *)data)->packet_id);
                    break;
                case NFQA_TIMESTAMP: {
                    struct nfqnl_msg_packet_timestamp *ts = data;
                    arrived = (int64_t)be64toh(ts->sec) * 1000000000LL + (int64_t)be64toh(ts->usec) * 1000 - wall_offset;
                    stamped = 1;
                    break;
                }
                }
                rem -= NLA_ALIGN(attr->nla_len);
                attr = (struct nlattr *)((char *)attr + NLA_ALIGN(attr->nla_len));
            }
            struct queue *q = &queues[num % MAX_QUEUES];
            if (q->have_id) missed += (uint32_t)(id - q->next_id);
            q->next_id = id + 1;
            q->have_id = 1;
            unstamped += !stamped;
            int64_t release = arrived + q->delay_ns;
            if (q->jitter_ns) release += (int64_t)((drand48() * 2 - 1) * (double)q->jitter_ns);
            if (release < q->last_release_ns) release = q->last_release_ns;  /* keeps the flow's order */
            q->last_release_ns = release;
            push(q, release, id);
            count++;
        }
    }
    packets += count;
    return count;
}

/* Accepts every packet due by now + slack, one batch verdict per queue. */
static void release_due(int64_t slack_ns) {
    static char msg[MAX_QUEUES * 64];
    size_t len = 0;
    int64_t now = clock_ns(CLOCK_MONOTONIC), horizon = now + slack_ns;
    for (int num = 0; num < MAX_QUEUES; num++) {
        struct queue *q = &queues[num];
        if (q->head == q->tail || q->items[q->head].release_ns > horizon) continue;
        uint32_t last = 0;
        while (q->head < q->tail && q->items[q->head].release_ns <= horizon) {
            double late = (double)(now - q->items[q->head].release_ns) / 1e6;  /* < 0: early, by at most half a tick */
            late_ms_sum += late;
            if (late > 1) {
                late_over_1ms++;
                if (late > late_ms_max) late_ms_max = late;
            }
            last = q->items[q->head++].id;
        }
        if (q->head == q->tail) q->head = q->tail = 0;
        char *at = msg + len;
        size_t start = len;
        len += put_header(at, NFQNL_MSG_VERDICT_BATCH, NLM_F_REQUEST, num);
        struct nfqnl_msg_verdict_hdr verdict = {.verdict = htonl(NF_ACCEPT), .id = htonl(last)};
        len += put_attr(msg + len, NFQA_VERDICT_HDR, &verdict, sizeof verdict);
        ((struct nlmsghdr *)at)->nlmsg_len = len - start;
    }
    if (len && send(nl, msg, len, 0) < 0) die("send verdict");
}

static int64_t next_due(void) {
    int64_t due = -1;
    for (int num = 0; num < MAX_QUEUES; num++) {
        struct queue *q = &queues[num];
        if (q->head < q->tail && (due < 0 || q->items[q->head].release_ns < due)) due = q->items[q->head].release_ns;
    }
    return due;
}

static void command(char *line) {
    int num;
    double delay, jitter;
    if (sscanf(line, "queue %d %lf %lf", &num, &delay, &jitter) == 3 && num >= 0 && num < MAX_QUEUES) {
        struct queue *q = &queues[num];
        if (!q->bound) bind_queue(num);
        q->bound = 1;
        q->delay_ns = (int64_t)(delay * 1e9);
        q->jitter_ns = (int64_t)(jitter * 1e9);
        printf("{\"queue\": %d}\n", num);
    } else if (strncmp(line, "stats", 5) == 0) {
        int bound = 0;
        for (int i = 0; i < MAX_QUEUES; i++) bound += queues[i].bound;
        struct rusage usage;
        getrusage(RUSAGE_SELF, &usage);
        printf("{\"packets\": %lld, \"missed\": %lld, \"unstamped\": %lld, \"held_max\": %lld, \"wakes\": %lld, "
               "\"late_ms_max\": %.3f, \"late_ms_sum\": %.3f, \"late_over_1ms\": %lld, \"priority\": \"%s\", "
               "\"queues\": %d, \"user_s\": %.6f, \"sys_s\": %.6f}\n",
               packets, missed, unstamped, held_max, wakes, late_ms_max, late_ms_sum, late_over_1ms, priority, bound,
               usage.ru_utime.tv_sec + usage.ru_utime.tv_usec / 1e6, usage.ru_stime.tv_sec + usage.ru_stime.tv_usec / 1e6);
    } else {
        printf("{\"error\": \"unknown command\"}\n");
    }
    fflush(stdout);
}

int main(void) {
    /* A real link does not slow down when the hosts compute: real-time priority keeps the holds
     * independent of the load the benchmark puts on the CPUs (the delayer sleeps between ticks). */
    struct sched_param param = {.sched_priority = 10};
    if (sched_setscheduler(0, SCHED_FIFO, &param) == 0) priority = "SCHED_FIFO 10";
    srand48(getpid() ^ clock_ns(CLOCK_REALTIME));

    nl = socket(AF_NETLINK, SOCK_RAW, NETLINK_NETFILTER);
    if (nl < 0) die("socket");
    int rcvbuf = 64 << 20, one = 1;
    if (setsockopt(nl, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof rcvbuf) < 0) die("SO_RCVBUFFORCE");
    if (setsockopt(nl, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one) < 0) die("NETLINK_NO_ENOBUFS");
    struct sockaddr_nl local = {.nl_family = AF_NETLINK};
    if (bind(nl, (struct sockaddr *)&local, sizeof local) < 0) die("bind");
    /* Received packets carry a stamp (skb->tstamp) only while some socket asks for stamps. */
    int stamper = socket(AF_INET, SOCK_DGRAM, 0);
    if (stamper < 0 || setsockopt(stamper, SOL_SOCKET, SO_TIMESTAMP, &one, sizeof one) < 0) die("SO_TIMESTAMP");

    char line[4096];
    size_t line_len = 0;
    int streaming = 0;
    struct pollfd fds[2] = {{.fd = nl, .events = POLLIN}, {.fd = 0, .events = POLLIN}};
    for (;;) {
        int64_t due = next_due(), wait = -1;  /* -1: nothing held, wait for packets or a command */
        if (due >= 0) {
            wait = due - clock_ns(CLOCK_MONOTONIC);
            if (wait < 0) wait = 0;
        }
        if (streaming) {  /* no wake per packet: sleep a tick (or to the next release), then read all */
            int64_t nap = wait < 0 || wait > TICK_NS ? TICK_NS : wait;
            struct timespec ts = {0, (long)nap};
            nanosleep(&ts, NULL);
            wait = 0;
        }
        struct timespec timeout = {wait / 1000000000LL, wait % 1000000000LL};
        if (ppoll(fds, 2, wait < 0 ? NULL : &timeout, NULL) < 0 && errno != EINTR) die("ppoll");
        wakes++;
        streaming = read_packets() > 0;
        release_due(streaming ? TICK_NS / 2 : 0);
        if (fds[1].revents) {
            ssize_t got = read(0, line + line_len, sizeof line - 1 - line_len);
            if (got <= 0) return 0;
            line_len += got;
            char *end;
            while ((end = memchr(line, '\n', line_len))) {
                *end = 0;
                command(line);
                line_len -= end + 1 - line;
                memmove(line, end + 1, line_len);
            }
        }
    }
}
